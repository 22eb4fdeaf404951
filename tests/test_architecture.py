"""The layout the README describes, enforced on the import graph (static: every `import` in every module,
inside functions too, except under `if TYPE_CHECKING`) and on file sizes.

- kernels_cuda/ and kernels_ascend/ import neither model, quantization, conformance nor backend code;
- glm5/ and quant/ use only the public backend interface (PUBLIC_BACKENDS), never a backend package;
- packages point one way (README "Layers"): backends <- the model core (glm5/core) <- glm5/parallel and
  quant <- the applications (the rest of glm5: train, vllm, deploy, port, onnx_export, the CLI, generate,
  doctor, the loader); no module imports from a layer above its own (LAYERS);
- no import cycle among the modules of one package, nor among those of glm5 and quant together;
- no module over MAX_LINES lines (STYLE rule 8).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backends", "conformance", "glm5", "kernels_ascend", "kernels_cuda", "quant")
MAX_LINES = 450

PUBLIC_BACKENDS = {
    "backends",
    "backends.argcheck",
    "backends.cache_layout",
    "backends.caps",
    "backends.custom_op",
    "backends.errors",
    "backends.expert_dispatch",
    "backends.formats",
    "backends.hooks",
    "backends.invariant",
    "backends.interface",
    "backends.layout",
    "backends.library",
    "backends.limits",
    "backends.linear_ce",
    "backends.moe",
    "backends.ops",
    "backends.registry",
    "backends.shadow",
    "backends.table",
    "backends.validation",
}
#: (importer prefix, imported prefix, why) edges allowed past the rules
EXCEPTIONS = [
    (
        "glm5.onnx_export",
        "backends.onnxruntime",
        "the ONNX export emits the onnxruntime backend's glm5-domain ONNX functions (and its chunk sizes)",
    ),
    (
        "glm5.port",
        "backends.reference",
        "the porting kit templates a new backend's stubs on the reference's declarations and records which "
        "ops a model needs with a reference subclass",
    ),
]
#: (layer, module prefixes) from the bottom up; a glm5 module under none of them is an application
LAYERS = [
    ("backends", ("backends",)),
    ("core", ("glm5.core",)),
    ("parallel/quant", ("glm5.parallel", "quant")),
    ("applications", ("glm5",)),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if "templates" in p.relative_to(ROOT).parts:  # generated-package templates are data
                continue
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path, type_only_too: bool = False) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if type_only_too:
            break
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            if len(subs) < len(node.names):
                out.append((base, node.lineno))
            out += [(s, node.lineno) for s in subs]
    return out


def _resolve(mod: str) -> str | None:
    while mod and mod not in MODULES:
        mod = mod.rpartition(".")[0]
    return mod or None


GRAPH: dict[str, set[str]] = {}
EDGES: list[tuple[str, str, int]] = []
for _name, _path in MODULES.items():
    GRAPH[_name] = set()
    for _mod, _line in _imports(_name, _path):
        target = _resolve(_mod)
        if target and target != _name:
            GRAPH[_name].add(target)
            EDGES.append((_name, target, _line))


def _excepted(src: str, dst: str) -> bool:
    return any(src.startswith(a) and dst.startswith(b) for a, b, _ in EXCEPTIONS)


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_kernels_import_no_project_code():
    bad = [
        f"{s} imports {d} (line {ln})"
        for s, d, ln in EDGES
        if _top(s).startswith("kernels_") and _top(d) in ("backends", "conformance", "glm5", "quant")
    ]
    assert not bad, "\n".join(bad)


def test_model_and_quantization_use_only_the_public_backend_interface():
    bad = [
        f"{s} imports {d} (line {ln})"
        for s, d, ln in EDGES
        if _top(s) in ("glm5", "quant")
        and _top(d) == "backends"
        and d not in PUBLIC_BACKENDS
        and not _excepted(s, d)
    ]
    assert not bad, "\n".join(bad)


def layer_of(mod: str) -> int | None:
    """The index in LAYERS of `mod`'s layer (the first whose prefix it has), None outside every layer."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    return None


def layer_violations(edges: list[tuple[str, str, int]]) -> list[str]:
    """Every import edge that points up: a module importing one of a higher layer."""
    bad = []
    for s, d, ln in edges:
        ls, ld = layer_of(s), layer_of(d)
        if ls is not None and ld is not None and ld > ls and not _excepted(s, d):
            bad.append(f"{s} ({LAYERS[ls][0]}) imports {d} ({LAYERS[ld][0]}) (line {ln})")
    return bad


def test_packages_point_one_way():
    bad = layer_violations(EDGES)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "src,dst",
    [
        ("glm5.core.model", "quant.load"),
        ("glm5.core.model", "glm5.parallel.plan"),
        ("glm5.core.checkpoint", "glm5.loader"),
        ("glm5.parallel.plan", "glm5.train.loop"),
        ("quant.load", "glm5.vllm.model"),
        ("quant.stream", "glm5.cli_args"),
        ("backends.registry", "glm5.core.config"),
        ("backends.ops", "quant.modules"),
    ],
)
def test_the_layer_rule_finds_a_planted_violation(src, dst):
    assert layer_violations([(src, dst, 1)]), f"{src} -> {dst} should point up"


def test_the_layer_rule_allows_imports_downwards():
    ok = [
        ("glm5.loader", "quant.load", 1),
        ("quant.load", "glm5.core.model", 1),
        ("glm5.core.moe", "backends", 1),
    ]
    assert layer_violations(ok) == []


def _cycles(nodes: set[str], graph: dict[str, set[str]] = GRAPH) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("group", [(p,) for p in PACKAGES] + [("glm5", "quant")], ids=lambda g: "+".join(g))
def test_no_import_cycles(group):
    nodes = {m for m in MODULES if _top(m) in group}
    assert _cycles(nodes) == []


def test_no_import_cycle_in_backends_counting_type_only_imports():
    """The backend layer's modules point one way even on paper: an import under `if TYPE_CHECKING` is
    a dependency a reader follows too (the front door's five-module circle of issue 32)."""
    nodes = {m for m in MODULES if _top(m) == "backends"}
    graph = {m: set() for m in nodes}
    for m in nodes:
        for mod, _ in _imports(m, MODULES[m], type_only_too=True):
            target = _resolve(mod)
            if target in nodes and target != m:
                graph[m].add(target)
    assert _cycles(nodes, graph) == []


def test_the_cycle_finder_finds_cycles():
    GRAPH["glm5.core.model"].add("glm5.core.config")
    GRAPH["glm5.core.config"].add("glm5.core.model")
    try:
        assert ["glm5.core.config", "glm5.core.model"] in _cycles({"glm5.core.model", "glm5.core.config"})
    finally:
        GRAPH["glm5.core.config"].discard("glm5.core.model")


def test_modules_stay_small():
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in big.items() if k > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split the family): {over}"

"""The layout the README describes, enforced on the import graph (static: every `import` in every module,
inside functions too, except under `if TYPE_CHECKING`) and on file sizes.

- kernels_cuda/ and kernels_ascend/ import neither model, quantization, conformance nor backend code;
- glm5/ and quant/ use only the public backend interface (PUBLIC_BACKENDS), never a backend package;
- packages point one way (README "Layers"): infrastructure (glm5/infra: files, locks, progress) <- backends
  <- the model core (glm5/core) <- glm5/parallel and quant <- the conformance suite <- the applications (the
  rest of glm5: train, vllm, weights, deploy, port, onnx_export, the CLI, generate, doctor, the loader); no
  module imports from a layer above its own (LAYERS);
- applications that stand side by side import nothing of each other (SEPARATE: the trainer and the vLLM
  plugin share what they share through a lower package, glm5/weights, glm5/core);
- no import cycle among the modules of one package, nor among those of glm5 and quant together;
- cohesion instead of a line cap (COHESION): what belongs together is one module or one package.
  A family of modules named `X` and `X_Y` side by side is one subject cut in two (the files the old
  450-line cap split: pipeline / pipeline_run / pipeline_stages): it is one module, or a package named by
  its subject whose modules are named by theirs (glm5/train/distributed/pipeline/{schedule,stages,run}.py).
  A private name (`_x`) is used only in its own module: a module that needs another's private helper is
  the same unit split apart, or the helper is public. A module past MAX_LINES (far above an op file's
  length, STYLE rule 8) is a family to split by subject, not by size.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backends", "conformance", "glm5", "kernels_ascend", "kernels_cuda", "quant")
MAX_LINES = 1000

PUBLIC_BACKENDS = {
    "backends",
    "backends.argcheck",
    "backends.cache_layout",
    "backends.caps",
    "backends.contract.custom_op",
    "backends.errors",
    "backends.moe.expert_parallel",
    "backends.formats",
    "backends.hooks",
    "backends.invariant.engine",
    "backends.interface",
    "backends.layout",
    "backends.contract.library",
    "backends.contract.limits",
    "backends.linear_ce",
    "backends.moe.dispatch",
    "backends.contract.ops",
    "backends.registry",
    "backends.shadow",
    "backends.contract.table",
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
    ("infra", ("glm5.infra",)),
    ("backends", ("backends",)),
    ("core", ("glm5.core",)),
    ("parallel/quant", ("glm5.parallel", "quant")),
    ("conformance", ("conformance",)),
    ("applications", ("glm5",)),
]
#: application packages that import nothing of each other (either way)
SEPARATE = [("glm5.train", "glm5.vllm")]
#: the packages held to the cohesion rules
COHESION = ("backends", "conformance", "glm5", "quant")
#: (module X, module X_Y) families allowed side by side, and why they are two subjects
FAMILY_EXCEPTIONS = [
    (
        "glm5.cli",
        "glm5.cli_args",
        "the command group imports every command; the options every command shares are imported by each, "
        "so one module would be an import cycle",
    ),
    (
        "quant.fp8",
        "quant.fp8_modules",
        "the FP8 copy of a model for RL rollouts vs the FP8 drop-in linear and expert modules it is built of",
    ),
]


def _op_modules(pair: tuple[str, str]) -> bool:
    """Both modules named by an op of the contract: one file per op is the layout of the reference (the
    declaration), of every backend and of the conformance cases (linear_cross_entropy and
    linear_cross_entropy_shard are two ops, SPEC 2.9 and 2.9.1)."""
    from backends.contract.ops import OPS

    return all(m.rpartition(".")[2] in OPS for m in pair)


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
        ("glm5.parallel.plan", "glm5.train.loop.trainer"),
        ("quant.load", "glm5.vllm.model"),
        ("quant.stream", "glm5.cli_args"),
        ("backends.registry", "glm5.core.config"),
        ("backends.contract.ops", "quant.modules"),
        ("conformance.cli", "glm5.cli_args"),
        ("glm5.infra.fsio", "glm5.core.config"),
        ("glm5.infra.progress", "backends"),
    ],
)
def test_the_layer_rule_finds_a_planted_violation(src, dst):
    assert layer_violations([(src, dst, 1)]), f"{src} -> {dst} should point up"


def test_the_layer_rule_allows_imports_downwards():
    ok = [
        ("glm5.loader", "quant.load", 1),
        ("quant.load", "glm5.core.model", 1),
        ("glm5.core.moe", "backends", 1),
        ("glm5.core.checkpoint", "glm5.infra.fsio", 1),
        ("conformance.report", "glm5.infra.fsio", 1),
        ("glm5.port.status", "conformance.report", 1),
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


def separation_violations(edges: list[tuple[str, str, int]]) -> list[str]:
    """Every import edge between two packages of SEPARATE (either way)."""
    bad = []
    for s, d, ln in edges:
        for a, b in SEPARATE:
            for x, y in ((a, b), (b, a)):
                if (s == x or s.startswith(x + ".")) and (d == y or d.startswith(y + ".")):
                    bad.append(f"{s} imports {d} (line {ln}): {a} and {b} share only through lower packages")
    return bad


def test_separate_applications_import_nothing_of_each_other():
    bad = separation_violations(EDGES)
    assert not bad, "\n".join(bad)


def test_the_separation_rule_finds_a_planted_import():
    assert separation_violations([("glm5.vllm.model", "glm5.train.rl.rollout", 1)])
    assert separation_violations([("glm5.train.rl.engines.local", "glm5.vllm.model", 1)])
    assert not separation_violations([("glm5.train.rl.engines.local", "glm5.weights.load", 1)])


def test_conformance_tests_backends_only():
    """The suite checks a backend against the reference: it imports backends and the infrastructure, never the
    model or the applications (which import it: `glm5 port`, `glm5 conformance`)."""
    bad = [
        f"{s} imports {d} (line {ln})"
        for s, d, ln in EDGES
        if _top(s) == "conformance"
        and _top(d) != "conformance"
        and _top(d) != "backends"
        and not d.startswith("glm5.infra")
    ]
    assert not bad, "\n".join(bad)


def test_infrastructure_imports_no_project_code():
    bad = [
        f"{s} imports {d} (line {ln})"
        for s, d, ln in EDGES
        if s.startswith("glm5.infra") and not d.startswith("glm5.infra")
    ]
    assert not bad, "\n".join(bad)


def families(modules: list[str]) -> list[tuple[str, str]]:
    """(X, X_Y) pairs of modules side by side in one package."""
    names = set(modules)
    out = []
    for m in sorted(names):
        pkg, _, leaf = m.rpartition(".")
        for o in sorted(names):
            opkg, _, oleaf = o.rpartition(".")
            if opkg == pkg and oleaf.startswith(leaf + "_") and not leaf.startswith("_"):
                out.append((m, o))
    return out


def test_a_family_is_one_module_or_a_package():
    allowed = {(a, b) for a, b, _ in FAMILY_EXCEPTIONS}
    found = [
        f
        for f in families([m for m in MODULES if _top(m) in COHESION])
        if f not in allowed and not _op_modules(f)
    ]
    assert not found, (
        "one subject in two modules (merge them, or make a package named by the subject): " + str(found)
    )


def test_the_family_rule_finds_a_planted_family():
    # names of no module of the tree (reorg scripts rewrite those of moved modules)
    assert families(["glm5.demo.pipeline", "glm5.demo.pipeline_run", "glm5.demo.loop"]) == [
        ("glm5.demo.pipeline", "glm5.demo.pipeline_run")
    ]
    assert families(["glm5.train.distributed.pipeline.schedule", "glm5.train.distributed.pipeline.run"]) == []


def private_imports(name: str, path: Path) -> list[str]:
    """`from M import _x` in module `name`, M another project module and _x not a module."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        if _top(base) not in PACKAGES or base == name:
            continue
        out += [
            f"{name} imports {base}.{a.name} (line {node.lineno})"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in MODULES
        ]
    return out


#: (importer, private name) allowed, and why
PRIVATE_EXCEPTIONS = [
    (
        "glm5.train.rl.engines.local",
        "glm5.train.distributed.checkpoint._model_state",
        "the sharded parameter's one description (issue 32 item 4) reworks that module; its whole-state "
        "gather becomes public there",
    ),
]


def test_private_names_stay_in_their_module():
    allowed = {f"{a} imports {b}" for a, b, _ in PRIVATE_EXCEPTIONS}
    bad = [
        line
        for name, path in MODULES.items()
        if _top(name) == "glm5"
        for line in private_imports(name, path)
        if line.rpartition(" (line")[0] not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_the_private_rule_finds_a_planted_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from glm5.core.checkpoint import _helper, read_config\nfrom glm5.core import checkpoint\n"
    )
    assert private_imports("glm5.planted", planted) == [
        "glm5.planted imports glm5.core.checkpoint._helper (line 1)"
    ]


def test_modules_stay_readable():
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in big.items() if k > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split the family by subject): {over}"


def test_the_top_level_of_backends_stays_small():
    """backends/*.py is the interface a porter reads first (Backend, caps, layouts, errors, registry);
    what belongs together beyond it is a sub-package (contract/, invariant/, moe/, one per backend)."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "backends").glob("*.py"))
    assert lines < 2000, f"backends/*.py holds {lines} lines: group a subject into a sub-package"

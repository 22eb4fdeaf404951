"""`glm5 ops [NAME]`: where an op lives, read from the op table and the registry, not from a written list.

Derived from code objects: the spec section (`backends.contract.ops.OPS`), the interface method, the
reference's function and each backend's (its op table entry, unwrapped, with `inspect.getsourcefile`), the
kernel modules an adapter imports (`kernels_*`), borrowed or not ported, and the conformance cases module.
Found by name, and said so: the spec heading (docs/spec.md), the tests and bench scripts whose file name
names the op (the longest op name in it wins: test_indexer_topk.py is indexer_topk's, not topk's), and
how many other files under tests/ mention it (a source checkout only; nothing here measures coverage).
A backend that cannot run here may not build its table: its module `<package>.<op>` is named instead.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[2]


def _rel(path: str | Path | None) -> str:
    if path is None:
        return "?"
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def where(fn: Callable[..., Any]) -> str:
    """`file:line function` of a function, through decorators (`functools.wraps`)."""
    fn = inspect.unwrap(fn)
    try:
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        line = 0
    return f"{_rel(inspect.getsourcefile(fn))}:{line} {fn.__qualname__}"


def kernels(fn: Callable[..., Any]) -> list[str]:
    """The kernel modules (`kernels_cuda`, `kernels_ascend`, ...) the adapter module of `fn` imports."""
    mod = sys.modules.get(inspect.unwrap(fn).__module__)
    found = set()
    for value in vars(mod).values() if mod else ():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("kernels_"):
            found.add(_rel(getattr(sys.modules.get(name), "__file__", None)))
    return sorted(found)


def spec_heading(section: str) -> str:
    spec = ROOT / "docs" / "spec.md"
    if not spec.is_file():
        return f"docs/spec.md section {section} (the docs are not installed here)"
    for line in spec.read_text(encoding="utf-8").splitlines():
        if line.startswith(f"### {section} "):
            return f"docs/spec.md {line.lstrip('# ')}"
    return f"docs/spec.md section {section} (no heading found)"


def op_of_file(stem: str) -> str | None:
    """The op a file name is about: the longest op name that is a run of its `_`-separated words."""
    from backends.contract.ops import OP_NAMES

    hits = [op for op in OP_NAMES if re.search(rf"(?:^|_){re.escape(op)}(?:_|$)", stem)]
    return max(hits, key=len, default=None)


def by_name(op: str, folder: str) -> tuple[list[str], int]:
    """Python files under ROOT/folder named for `op`, and how many others mention it as a word."""
    word = re.compile(rf"\b{re.escape(op)}\b")
    named, others = [], 0
    for p in sorted((ROOT / folder).rglob("*.py")):
        if op_of_file(p.stem) == op:
            named.append(_rel(p))
        elif word.search(p.read_text(encoding="utf-8", errors="ignore")):
            others += 1
    return named, others


def _module_file(be: Any, op: str) -> str | None:
    """`<package>.<op>` of a backend's package (the op table convention), if that module exists."""
    try:
        spec = importlib.util.find_spec(f"{type(be).__module__}.{op}")
    except (ImportError, ValueError):
        return None
    return _rel(spec.origin) if spec is not None and spec.origin else None


def backend_rows(op: str) -> list[tuple[str, str]]:
    """(backend, where `op` is served there) for every known backend, built-in and plugin."""
    from backends import registry

    rows = []
    for name, ok, reason in registry.available():
        be = registry.loaded(name)
        if be is None:
            rows.append((name, f"unknown ({reason})"))
            continue
        if op in be.borrowed:
            text = "borrowed (the reference on host copies)"
        elif op in be.ops:
            fn = be.ops[op].fn
            text = where(fn) + "".join(f"; kernel {k}" for k in kernels(fn))
            text += "".join(f"; {k}: {v}" for k, v in be.ops[op].caps.describe_limits().items())
        elif not ok and (module := _module_file(be, op)):
            text = f"{module} (its table is not built here)"
        else:
            text = "not ported"
        rows.append((name, text if ok else f"{text} [not available here: {reason}]"))
    return rows


def describe(op: str) -> list[tuple[str, str]]:
    """(what, where) lines for one op."""
    from backends import registry
    from backends.contract.ops import OPS
    from backends.interface import Backend
    from conformance import cases

    ref = registry.loaded("reference")
    out = [
        ("spec", spec_heading(OPS[op].spec_section)),
        ("declaration", where(OPS[op].signature)),
        ("interface", where(getattr(Backend, op))),
        ("reference", where(ref.ops[op].fn) if ref is not None else "the reference failed to load"),
    ]
    out += [(f"backend {name}", text) for name, text in backend_rows(op)]
    out.append(("cases", _rel(cases.module(op).__file__)))
    for folder in ("tests", "bench"):
        if not (ROOT / folder).is_dir():
            out.append((folder, f"no {folder}/ here (not a source checkout)"))
            continue
        named, others = by_name(op, folder)
        text = ", ".join(named) if named else "no file named for the op"
        out.append((f"{folder} (by file name)", f"{text}; {others} other files mention it"))
    return out


def _known() -> str:
    from backends.contract.ops import OP_NAMES

    return ", ".join(OP_NAMES)


@click.command("ops")
@click.argument("name", required=False)
def ops_cmd(name: str | None) -> None:
    """Where op NAME lives: spec section, reference, each backend's file and kernel (or borrowed / not
    ported), conformance cases, tests, bench. Without NAME: every op of the contract."""
    from backends.contract.ops import OPS

    if name is None:
        for op, spec in OPS.items():
            click.echo(f"{op:<26} SPEC {spec.spec_section:<4} dtypes {', '.join(spec.dtype_axis)}")
        return
    if name not in OPS:
        raise click.BadParameter(f"unknown op {name!r}; known: {_known()}", param_hint="'NAME'")
    click.echo(name)
    for what, text in describe(name):
        click.echo(f"  {what:<22} {text}")

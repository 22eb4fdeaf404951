"""The op declarations (backends/decl.py: `OpDecl`), one module per op, `backends/decls/<op>.py`, each
defining `DECL`; the table is every such module, in spec-section order (2.1 ... 2.10, then 7.1 ... 7.7).

They sit beside backends/reference/ with the same file names rather than inside the reference modules:
the reference is the semantics a porter reads and copies, imported by every backend (and it imports the
op table, so the table cannot import it at load); the declaration is the contract's data about the op.
"""

from __future__ import annotations

import importlib
import pkgutil

from backends.decl import OpDecl


def _section_key(d: OpDecl) -> tuple[int, ...]:
    return tuple(int(p) for p in d.spec_section.split("."))


def _load() -> dict[str, OpDecl]:
    decls = []
    for m in pkgutil.iter_modules(__path__):
        if m.name.startswith("_"):
            continue
        d = importlib.import_module(f"{__name__}.{m.name}").DECL
        if not isinstance(d, OpDecl) or d.name != m.name:
            raise TypeError(f"backends/decls/{m.name}.py: DECL must be the OpDecl of {m.name!r}")
        decls.append(d)
    return {d.name: d for d in sorted(decls, key=_section_key)}


#: op name -> its declaration, in spec-section order
DECLS: dict[str, OpDecl] = _load()

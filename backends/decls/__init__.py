"""The op table's source: every op's declaration (backends/decl.py: `OpDecl`), in spec-section order
(2.1 ... 2.10, then 7.1 ... 7.7).

An op's declaration sits in its reference module, `backends/reference/<op>.py` (`DECL`, beside the body
it declares: the reference function is the signature); the ops not yet moved there keep it in
`backends/decls/<op>.py`. The reference package imports nothing at load and its op modules import only
the leaves of the table (backends/decl.py, backends/decls/_common.py, the validators' vocabulary), so
reading them here makes no cycle. What several declarations share: `_common.py`, `_sized.py`.
"""

from __future__ import annotations

import importlib
import pkgutil

import backends.reference
from backends.decl import OpDecl


def _section_key(d: OpDecl) -> tuple[int, ...]:
    return tuple(int(p) for p in d.spec_section.split("."))


def _load() -> dict[str, OpDecl]:
    found: dict[str, OpDecl] = {}
    for where in (__name__, backends.reference.__name__):
        path = __path__ if where == __name__ else backends.reference.__path__
        for m in pkgutil.iter_modules(path):
            if m.name.startswith("_") or m.name in found or m.name == "backend":
                continue
            d = getattr(importlib.import_module(f"{where}.{m.name}"), "DECL", None)
            if d is None and where != __name__:
                continue  # a helper module of the reference (fp8_format)
            if not isinstance(d, OpDecl) or d.name != m.name:
                raise TypeError(f"{where}.{m.name}: DECL must be the OpDecl of {m.name!r}")
            found[m.name] = d
    return {d.name: d for d in sorted(found.values(), key=_section_key)}


#: op name -> its declaration, in spec-section order
DECLS: dict[str, OpDecl] = _load()

"""The ops of the contract (SPEC 2 and 7): the op declarations (`OpDecl`, each in backends/reference/<op>.py).

The conformance matrix's denominator is fixed by this table: every op x every value of its
dtype axis, whatever a backend claims.
"""

from __future__ import annotations

from backends.decl import OpDecl
from backends.decls import DECLS
from backends.decls._common import FLOATS, FP8, dtype_name

__all__ = ["FLOATS", "FP8", "OPS", "OP_NAMES", "OpSpec", "dtype_name"]

#: what the front door and the conformance suite read of an op (name, spec_section, dtype_axis,
#: dtype_of, validate, values, cache_arg, grad_args): its declaration
OpSpec = OpDecl

OPS: dict[str, OpDecl] = DECLS

OP_NAMES: tuple[str, ...] = tuple(OPS)

"""ascend backend: fp8_sparse_mla_attention (SPEC 7) is declared NotSupported.

Why: backends/ascend/fp8_unsupported.py.
"""

from backends.ascend.fp8_unsupported import declined
from backends.cache_layout import FP8_KINDS
from backends.contract.ops import FLOATS
from backends.reference.fp8_sparse_mla_attention import fp8_sparse_mla_attention as _spec

IMPL = declined(_spec, FLOATS, FP8_KINDS)

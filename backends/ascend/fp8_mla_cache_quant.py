"""ascend backend: fp8_mla_cache_quant (SPEC 7) is declared NotSupported.

Why: backends/ascend/fp8_unsupported.py.
"""

from backends.ascend.fp8_unsupported import declined
from backends.contract.ops import FLOATS
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant as _spec

IMPL = declined(_spec, FLOATS)

"""ascend backend: fp8_quant_group (SPEC 7) is declared NotSupported.

Why: backends/ascend/fp8_unsupported.py.
"""

from backends.ascend.fp8_unsupported import declined
from backends.contract.ops import FLOATS
from backends.reference.fp8_quant_group import fp8_quant_group as _spec

IMPL = declined(_spec, FLOATS)

"""ascend backend: fp8_indexer_logits (SPEC 7) is declared NotSupported.

Why: backends/ascend/fp8_unsupported.py.
"""

from backends.ascend.fp8_unsupported import declined
from backends.contract.ops import FP8
from backends.reference.fp8_indexer_logits import fp8_indexer_logits as _spec

IMPL = declined(_spec, FP8, ("ragged", "paged"))

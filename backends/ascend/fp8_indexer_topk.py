"""ascend backend: fp8_indexer_topk (SPEC 7) is declared NotSupported.

Why: backends/ascend/fp8_unsupported.py.
"""

from backends.ascend.fp8_unsupported import declined
from backends.contract.ops import FP8
from backends.reference.fp8_indexer_topk import fp8_indexer_topk as _spec

IMPL = declined(_spec, FP8, ("ragged", "paged"))

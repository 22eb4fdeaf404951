"""Conformance cases for `fp8_indexer_topk` (SPEC 7.5): the input families of fp8_indexer_logits with
topk 2048 on the realistic cases (more keys than topk) and small topk elsewhere; indices compared under
the declared tie rule on the reference FP8 logits (fp8_compare.fp8_indexer_topk).

Semantics: backends/reference/fp8_indexer_topk.py (SPEC 7.5)
"""

from __future__ import annotations

from conformance.case import Output
from conformance.cases._common import Subset, request_subset
from conformance.cases.fp8_indexer_logits import shared_cases

OUTPUTS = (Output("indices", "fp8_indexer_topk"),)


def _with_topk(a: dict) -> dict:
    longest = max(a["layout"].host()["seqlens_k"], default=0)
    return a | {"topk": 2048 if longest > 4000 else 16}


CASES = shared_cases("fp8_indexer_topk", OUTPUTS, _with_topk)


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "weights"), "k_cache")

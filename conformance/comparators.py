"""Every comparator by name (`Output.comparator`), and `compare`, which applies one: the element-wise
ones of conformance/compare.py, the top-k contracts of conformance/topk_contract.py (they need the
reference's ops) and the FP8 ones of conformance/fp8_compare.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conformance import compare as _base
from conformance import fp8_compare, topk_contract
from conformance.compare import Check, Context

COMPARATORS = _base.COMPARATORS | topk_contract.COMPARATORS | fp8_compare.COMPARATORS


def compare(
    output: str,
    comparator: str,
    actual: Any,
    expected: torch.Tensor,
    ctx: Context,
    params: Mapping[str, float] | None = None,
) -> Check:
    if expected is None:  # an output the call asked not to get (sparse_mla_attention, return_lse=False)
        ok = actual is None
        why = "" if ok else f"{output}: not requested, expected None, got {type(actual).__name__}"
        return Check(output, ok, why)
    if comparator not in COMPARATORS:
        raise KeyError(f"unknown comparator {comparator!r}; known: {sorted(COMPARATORS)}")
    return COMPARATORS[comparator](output, actual, expected, ctx, **dict(params or {}))

"""The comparators catch what they must and pass what they should (SPEC 4)."""

from __future__ import annotations

import torch

import backends
from conformance.comparators import compare
from conformance.compare import Context, calc_diff, ulp_of


def ctx(op="x", dtype="bfloat16", tie_rule=None, **args):
    return Context(op, dtype, args, tie_rule=tie_rule, reference=backends.get("reference"))


def next_up(t: torch.Tensor, n: int = 1) -> torch.Tensor:
    """n representable steps up, in t's own dtype."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return (t.view(bits) + n).view(t.dtype)


def test_one_ulp_bf16_passes_default_and_attention():
    r = torch.randn(64, 32).bfloat16()
    assert compare("out", "default", next_up(r), r, ctx()).ok
    # a kernel that rounds its fp32 result differently moves some elements by one ulp, not all of them
    # the same way (one ulp up everywhere is a 0.4% bias, and the global metric rightly flags it)
    flip = torch.rand(r.shape, generator=torch.Generator().manual_seed(1)) < 0.2
    assert compare("out", "attention", torch.where(flip, next_up(r), r), r, ctx()).ok
    assert not compare("out", "attention", next_up(r, 2), r, ctx()).ok


def test_attention_catches_large_error_and_reports_worst():
    r = torch.randn(8, 4, 16).bfloat16()
    a = r.clone()
    a[3, 2, 5] += 0.5
    res = compare("out", "attention", a, r, ctx())
    assert not res.ok
    assert res.metrics["mismatches"] == 1
    assert res.worst[0]["index"] == [3, 2, 5]
    assert res.worst[0]["allowed"] > 0


def test_attention_global_metric_catches_small_uniform_bias():
    r = torch.randn(4096).float()
    a = r * 1.01  # 1% everywhere: inside 3/128 per element, but 1 - cos ~ 5e-5 > 7e-6
    res = compare("out", "attention", a.bfloat16(), r.bfloat16(), ctx())
    assert not res.ok and "global" in res.message
    assert calc_diff(r, r) == 0.0


def test_nan_and_inf_positions_must_match():
    r = torch.tensor([1.0, float("nan"), float("-inf"), 2.0])
    for a in (
        torch.tensor([1.0, 0.0, float("-inf"), 2.0]),
        torch.tensor([1.0, float("nan"), float("inf"), 2.0]),
        torch.tensor([float("nan"), float("nan"), float("-inf"), 2.0]),
    ):
        res = compare("lse", "lse", a, r, ctx(dtype="float32"))
        assert not res.ok and "positions differ" in res.message
    assert compare("lse", "lse", r.clone(), r, ctx(dtype="float32")).ok


def test_exact_int8_off_by_one_fails_with_index():
    r = torch.randint(-128, 127, (5, 7), dtype=torch.int8)
    a = r.clone()
    a[4, 6] += 1
    res = compare("x_q", "exact", a, r, ctx())
    assert not res.ok and res.worst[0]["index"] == [4, 6]
    assert compare("x_q", "exact", r.clone(), r, ctx()).ok


def test_shape_and_dtype_mismatch_fail():
    r = torch.zeros(3, 4)
    assert not compare("o", "default", torch.zeros(4, 3), r, ctx(dtype="float32")).ok
    assert not compare("o", "default", torch.zeros(3, 4, dtype=torch.float64), r, ctx(dtype="float32")).ok


def test_ulp_comparator_bounds():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        # mantissas in [1.1, 1.9): three steps up stay in the binade, so the ulp is the same
        r = ((torch.rand(256) * 0.8 + 1.1) * 2.0 ** torch.randint(-4, 5, (256,))).to(dt)
        assert compare("out", "ulp", next_up(r), r, ctx()).ok
        assert not compare("out", "ulp", next_up(r, 3), r, ctx()).ok
        assert compare("out", "ulp", next_up(r, 3), r, ctx(), {"ulps": 3}).ok
    assert float(ulp_of(torch.tensor([1.0]), torch.bfloat16)) == 2.0**-7


def test_swapped_tie_fails_lower_index_passes_weak_contract():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.5]])
    ref_v, ref_i = backends.get("reference").topk(x, 2)
    assert ref_i.tolist() == [[1, 2]]
    swapped = torch.tensor([[2, 1]], dtype=torch.int32)
    assert not compare("indices", "topk_indices", swapped, ref_i, ctx("topk", tie_rule="lower_index", x=x)).ok
    assert compare("indices", "topk_indices", swapped, ref_i, ctx("topk", tie_rule="none", x=x)).ok


def test_weak_contract_catches_wrong_value_duplicates_and_padding():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.5, 2.0]])
    _, ref_i = backends.get("reference").topk(x, 3, torch.tensor([5]))
    c = ctx("topk", tie_rule="none", x=x, lengths=torch.tensor([5]))
    for bad in ([[1, 2, 0]], [[1, 1, 4]], [[1, 2, -1]], [[1, 2, 7]]):
        res = compare("indices", "topk_indices", torch.tensor(bad, dtype=torch.int32), ref_i, c)
        assert not res.ok, bad


def test_indexer_topk_weak_contract_uses_reference_logits():
    from conformance.cases.indexer_logits import indexer_inputs

    a = indexer_inputs(
        torch.Generator().manual_seed(0), "float32", [2], [12], plateau=0.2, weights="positive"
    )
    ref = backends.get("reference").indexer_topk(**a, topk=10)
    c = ctx("indexer_topk", dtype="float32", tie_rule="none", **a)
    row = ref[1].tolist()
    zeros = [i for i in row if i >= 0][-2:]  # two plateau (score 0) keys: swapping them is a tie
    swapped = ref.clone()
    swapped[1, row.index(zeros[0])], swapped[1, row.index(zeros[1])] = zeros[1], zeros[0]
    assert compare("indices", "indexer_topk_indices", swapped, ref, c).ok
    assert not compare(
        "indices", "indexer_topk_indices", swapped, ref, ctx("indexer_topk", tie_rule="lower_index")
    ).ok

"""indexer_topk under a declared near-tie tolerance: swaps of keys whose reference logits differ by
less than the tolerance pass; structural ties (zero scores, identical keys) must keep lower-index order."""

import torch

import backends
from backends import SeqLayout
from conformance.compare import Context
from conformance.topk_contract import indexer_topk_indices

REF = backends.get("reference")


def _case(keys: torch.Tensor, q: torch.Tensor):
    layout = SeqLayout.from_lengths([1], [keys.shape[0]])
    args = {
        "q": q,
        "k_cache": keys,
        "weights": torch.ones(1, q.shape[1]),
        "layout": layout,
        "topk": keys.shape[0],
    }
    return args, REF.indexer_topk(**args)


def _check(args, actual, expected, **tol):
    ctx = Context("indexer_topk", "float32", args, tie_rule="lower_index", reference=REF)
    return indexer_topk_indices("indices", actual, expected, ctx, **tol)


def _swap(idx: torch.Tensor, a: int, b: int) -> torch.Tensor:
    out = idx.clone()
    out[0, a], out[0, b] = idx[0, b], idx[0, a]
    return out


def test_near_tie_swap_needs_a_declared_tolerance():
    keys = torch.tensor([[1.0], [1.0 + 2**-20], [3.0], [0.5]])  # keys 0 and 1: one step apart
    args, ref = _case(keys, torch.ones(1, 1, 1))
    assert ref[0].tolist() == [2, 1, 0, 3]
    swapped = _swap(ref, 1, 2)
    assert not _check(args, swapped, ref).ok  # default: bitwise
    res = _check(args, swapped, ref, near_tie_rtol=1e-5)
    assert res.ok and res.metrics["near_tie_swaps"] == 2
    far = _swap(ref, 0, 1)  # 3.0 vs 1.0: not a near tie
    assert not _check(args, far, ref, near_tie_rtol=1e-5).ok


def test_structural_ties_keep_the_rule_under_a_tolerance():
    keys = torch.tensor([[-1.0], [2.0], [-3.0], [2.0]])  # zeros at 0 and 2 (ReLU), identical keys 1 and 3
    args, ref = _case(keys, torch.ones(1, 1, 1))
    assert ref[0].tolist() == [1, 3, 0, 2]
    for a, b in ((0, 1), (2, 3)):
        res = _check(args, _swap(ref, a, b), ref, near_tie_rtol=1e-3, near_tie_atol=1e-3)
        assert not res.ok, (a, b)
        assert "structural tie" in res.worst[0]["allowed"]


def test_padding_slots_must_match():
    keys = torch.tensor([[1.0], [2.0]])
    layout = SeqLayout.from_lengths([1], [2])
    args = {
        "q": torch.ones(1, 1, 1),
        "k_cache": keys,
        "weights": torch.ones(1, 1),
        "layout": layout,
        "topk": 3,
    }
    ref = REF.indexer_topk(**args)
    assert ref[0].tolist() == [1, 0, -1]
    bad = torch.tensor([[1, -1, 0]], dtype=torch.int32)
    assert not _check(args, bad, ref, near_tie_rtol=1.0, near_tie_atol=1.0).ok

"""The chunked projection + cross-entropy on a vocabulary split over ranks (glm5/parallel/vocab.py) against
the reference backend's `linear_cross_entropy` on the full weight.

Tolerance (fp32): the loss within 1e-6 relative, every gradient element within 1e-6 of that gradient's
largest element: the split log-sum-exp (max and sum of exponentials combined over ranks) rounds
differently from one logsumexp.
"""

from __future__ import annotations

import math

import torch

import backends
from glm5.parallel import vocab
from glm5.parallel.group import Single, TorchGroup, enter
from glm5.parallel.vocab import vocab_parallel_linear_cross_entropy
from tests.ranks import run_ranks

N, D, V = 13, 16, 24
LOSS_TOL = dict(rtol=1e-6, atol=0.0)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-6 of the largest element: a gradient element is a sum with cancellation, so its own
    relative error is unbounded where it nearly cancels to zero."""
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-6 * float(want.abs().max()))


def _case(name: str):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    if name == "all-ignored":
        t = torch.full((N,), -100)
    else:  # targets on both halves of the vocabulary, and some ignored rows
        t = torch.randint(0, V, (N,), generator=g)
        t[:4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])
        t[[5, 9]] = -100
    return h, w, t


CASES = ("mixed", "all-ignored")


def _reference(name: str):
    h, w, t = _case(name)
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = backends.get("reference").linear_cross_entropy(h, w, t)
    (1.5 * loss).backward()
    return loss.detach(), h.grad, w.grad


def _sharded(rank: int, world: int) -> dict:
    vocab.CHUNK_ELEMS = 4 * (V // world)  # 4 rows per chunk: several chunks, a short last one
    group = TorchGroup()
    out = {}
    for name in CASES:
        h, w, t = _case(name)
        width = V // world
        shard = w[rank * width : (rank + 1) * width].clone().requires_grad_(True)
        h.requires_grad_(True)
        loss = vocab_parallel_linear_cross_entropy(enter(h, group), shard, t, group, rank * width)
        (1.5 * loss).backward()
        out[name] = tuple(x.detach().numpy() for x in (loss, h.grad, shard.grad))
    return out  # numpy arrays: pickled by value, not as shared memory a finished rank takes with it


def test_two_ranks_match_the_full_vocabulary_reference():
    per_rank = run_ranks(_sharded, 2)
    for name in CASES:
        ref_loss, ref_dh, ref_dw = _reference(name)
        (l0, dh0, dw0), (l1, dh1, dw1) = (tuple(map(torch.from_numpy, r[name])) for r in per_rank)
        assert torch.equal(l0, l1) or (l0.isnan() and l1.isnan())  # the same bits on every rank
        assert torch.equal(dh0, dh1)
        if name == "all-ignored":
            assert math.isnan(float(l0)) and math.isnan(float(ref_loss))
            assert not dh0.any() and not dw0.any() and not dw1.any()
            continue
        torch.testing.assert_close(l0, ref_loss, **LOSS_TOL)
        _close(dh0, ref_dh)
        _close(torch.cat([dw0, dw1]), ref_dw)


def test_single_group_matches_the_reference(monkeypatch):
    monkeypatch.setattr(vocab, "CHUNK_ELEMS", 5 * V)
    for name in CASES:
        ref_loss, ref_dh, ref_dw = _reference(name)
        h, w, t = _case(name)
        h.requires_grad_(True)
        w.requires_grad_(True)
        loss = vocab_parallel_linear_cross_entropy(h, w, t, Single(), 0)
        (1.5 * loss).backward()
        if name == "all-ignored":
            assert loss.isnan() and not h.grad.any() and not w.grad.any()
            continue
        torch.testing.assert_close(loss.detach(), ref_loss, **LOSS_TOL)
        _close(h.grad, ref_dh)
        _close(w.grad, ref_dw)


def test_a_target_outside_every_shard_is_nan_not_a_silent_loss():
    h, w, t = _case("mixed")
    t[0] = V  # past the last row: no rank owns it
    assert vocab_parallel_linear_cross_entropy(h, w, t, Single(), 0).isnan()


def test_shapes_are_checked_in_one_line():
    h, w, t = _case("mixed")
    try:
        vocab_parallel_linear_cross_entropy(h, w[:, :3], t, Single(), 0)
    except ValueError as e:
        assert "weight_shard" in str(e)
    else:
        raise AssertionError("expected a ValueError")

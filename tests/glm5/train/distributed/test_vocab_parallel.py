"""The chunked projection + cross-entropy on a vocabulary split over ranks (glm5/parallel/vocab.py, through
each rank's backend's `linear_cross_entropy_shard`) against the reference backend's `linear_cross_entropy`
on the full weight.

Tolerance (fp32): the loss within 1e-6 relative, every gradient element within 1e-6 of that gradient's
largest element: the split log-sum-exp (max and sum of exponentials combined over ranks) rounds
differently from one logsumexp.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import backends
from backends.reference import linear_cross_entropy_shard as shard_ref
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
BACKENDS = ("reference", "cpu")


def _reference(name: str):
    h, w, t = _case(name)
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = backends.get("reference").linear_cross_entropy(h, w, t)
    (1.5 * loss).backward()
    return loss.detach(), h.grad, w.grad


def _sharded(rank: int, world: int) -> dict:
    # the reference op's chunks: 4 rows each, several chunks and a short last one
    shard_ref._CHUNK_ELEMS = 4 * (V // world)
    group = TorchGroup()
    out = {}
    for bname in BACKENDS:
        backend = backends.get(bname)
        backend.calls.clear()
        for name in CASES:
            h, w, t = _case(name)
            width = V // world
            shard = w[rank * width : (rank + 1) * width].clone().requires_grad_(True)
            h.requires_grad_(True)
            loss = vocab_parallel_linear_cross_entropy(
                enter(h, group), shard, t, group, rank * width, backend
            )
            (1.5 * loss).backward()
            out[bname, name] = tuple(x.detach().numpy() for x in (loss, h.grad, shard.grad))
        out[bname, "calls"] = dict(backend.calls)
    return out  # numpy arrays: pickled by value, not as shared memory a finished rank takes with it


@pytest.mark.parametrize("bname", BACKENDS)
def test_two_ranks_match_the_full_vocabulary_reference(bname):
    per_rank = _two_ranks()
    for r in per_rank:  # the backend's op ran, forward and declared backward, once per loss
        calls = r[bname, "calls"]
        assert calls["linear_cross_entropy_shard"] == len(CASES), calls
        assert calls["linear_cross_entropy_shard.backward"] == len(CASES), calls
    for name in CASES:
        ref_loss, ref_dh, ref_dw = _reference(name)
        (l0, dh0, dw0), (l1, dh1, dw1) = (tuple(map(torch.from_numpy, r[bname, name])) for r in per_rank)
        assert torch.equal(l0, l1) or (l0.isnan() and l1.isnan())  # the same bits on every rank
        assert torch.equal(dh0, dh1)
        if name == "all-ignored":
            assert math.isnan(float(l0)) and math.isnan(float(ref_loss))
            assert not dh0.any() and not dw0.any() and not dw1.any()
            continue
        torch.testing.assert_close(l0, ref_loss, **LOSS_TOL)
        _close(dh0, ref_dh)
        _close(torch.cat([dw0, dw1]), ref_dw)


@functools.cache
def _two_ranks() -> list:
    return run_ranks(_sharded, 2)


def test_single_group_matches_the_reference(monkeypatch):
    monkeypatch.setattr(shard_ref, "_CHUNK_ELEMS", 5 * V)
    ref = backends.get("reference")
    for name in CASES:
        ref_loss, ref_dh, ref_dw = _reference(name)
        h, w, t = _case(name)
        h.requires_grad_(True)
        w.requires_grad_(True)
        loss = vocab_parallel_linear_cross_entropy(h, w, t, Single(), 0, ref)
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
    ref = backends.get("reference")
    assert vocab_parallel_linear_cross_entropy(h, w, t, Single(), 0, ref).isnan()


def test_shapes_are_checked_in_one_line():
    h, w, t = _case("mixed")
    try:
        vocab_parallel_linear_cross_entropy(h, w[:, :3], t, Single(), 0, backends.get("cpu"))
    except ValueError as e:
        assert "weight_shard" in str(e)
    else:
        raise AssertionError("expected a ValueError")

"""One way to differentiate (issue 22 item 2): every differentiable op declares its backward
(`OpImpl.backward`, from saved inputs and outputs), and a training step runs each forward once.

The counts come from bench/train_step_calls.py (the reference's forward functions count their own runs,
so a forward recomputed inside a backward would show)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import backends
from backends.caps import OpCaps, OpImpl
from backends.contract import custom_op, door
from backends.contract.ops import FLOATS
from tests.backends.reference._cases import pack

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from train_step_calls import step_calls  # noqa: E402


def test_a_training_step_runs_each_forward_once():
    calls, forwards = step_calls("reference", stage="sparse", mtp_steps=1)
    assert forwards["linear_cross_entropy"] == 2  # the LM loss and one MTP step: 4 with a recompute
    for op in ("linear_cross_entropy", "sparse_mla_attention", "indexer_logits", "grouped_matmul"):
        assert calls[op] >= 1 and forwards[op] == calls[op], op  # no forward inside a backward
        assert calls[f"{op}.backward"] == calls[op], op  # each use differentiated by its declared backward


def test_differentiable_without_a_declared_backward_is_refused():
    with pytest.raises(ValueError, match="declares its backward"):
        OpImpl(lambda **a: None, OpCaps(FLOATS, differentiable=True))


def test_no_private_dispatch_state_is_read_or_flipped():
    assert "torch._C" not in inspect.getsource(custom_op)
    assert "torch._C" not in inspect.getsource(door)


def _paged(seed: int):
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [3, 2], [6, 9]
    keys = [torch.randn(n, 8, generator=g) for n in k_lens]
    cache, layout = pack(keys, q_lens, block_size=4, seed=seed, d=8)
    return g, q_lens, k_lens, cache.nan_to_num(0.0), layout


def _grads(out, inputs, g_out):
    return torch.autograd.grad(out, inputs, g_out)


def test_indexer_logits_backward_matches_autograd_of_the_forward_on_a_paged_cache():
    from backends.reference.indexer_logits import indexer_logits as plain  # plain torch: autograd runs

    g, q_lens, _, cache, layout = _paged(3)
    q, w = torch.randn(sum(q_lens), 2, 8, generator=g), torch.randn(sum(q_lens), 2, generator=g)
    ins = [t.clone().requires_grad_() for t in (q, cache, w)]
    got = backends.get("reference").indexer_logits(*ins, layout)
    g_out = torch.randn(got.shape, generator=g).masked_fill(got.isinf(), 0.0)
    mine = _grads(got.masked_fill(got.isinf(), 0.0), ins, g_out)
    ref_ins = [t.clone().requires_grad_() for t in (q, cache, w)]
    want = plain(*ref_ins, layout)
    for a, b in zip(mine, _grads(want.masked_fill(want.isinf(), 0.0), ref_ins, g_out), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sparse_attention_backward_matches_autograd_of_the_forward_on_a_paged_cache():
    from backends.reference.sparse_mla_attention import sparse_mla_attention as plain

    g, q_lens, k_lens, cache, layout = _paged(5)
    t = sum(q_lens)
    idx = torch.randint(-1, 10, (t, 6), generator=g, dtype=torch.int32)  # -1 and out of range skipped
    q = torch.randn(t, 2, 8, generator=g)
    g_out, g_lse = torch.randn(t, 2, 6, generator=g), torch.randn(t, 2, generator=g)
    results = []
    for fn in (backends.get("reference").sparse_mla_attention, plain):
        ins = [x.clone().requires_grad_() for x in (q, cache)]
        out, lse = fn(*ins, idx, layout, 0.3, 6)
        results.append(_grads([out, lse.masked_fill(lse.isinf(), 0.0)], ins, [g_out, g_lse]))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

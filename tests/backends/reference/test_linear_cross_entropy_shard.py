"""A vocabulary shard's statistics (SPEC 2.9.1): a hand case, the plain definition with torch autograd
(values and gradients, chunking forced), and the combination of two shards' statistics giving the
unsplit vocabulary's cross-entropy and its fp64 gradients (the max carrying no gradient is exact).

Semantics: backends/reference/linear_cross_entropy_shard.py (SPEC 2.9.1)
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import backends
from backends.reference.linear_cross_entropy_shard import linear_cross_entropy_shard_naive

mod = importlib.import_module("backends.reference.linear_cross_entropy_shard")
BACKENDS = ("reference", "cpu")


def test_hand_case():
    h = torch.tensor([[1.0], [1.0], [1.0]])
    w = torch.tensor([[0.0], [math.log(3.0)]])  # this shard's logits (0, ln 3): max ln 3, sumexp 4/3
    m, s, t = backends.get("reference").linear_cross_entropy_shard(h, w, torch.tensor([10, 11, 12]), 10)
    assert m.tolist() == pytest.approx([math.log(3.0)] * 3, rel=1e-6)
    assert s.tolist() == pytest.approx([4.0 / 3.0] * 3, rel=1e-6)
    assert t.tolist() == pytest.approx([0.0, math.log(3.0), 0.0], abs=1e-6)  # row 3's target: another shard


@pytest.mark.parametrize("bname", BACKENDS)
@pytest.mark.parametrize("rows", [None, 3, 1])
def test_chunked_op_matches_the_definition(bname, rows, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(mod, "_CHUNK_ELEMS", rows * 20)  # V = 20 below (the cpu op keeps its own)
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(11, 16, generator=g), torch.randn(20, 16, generator=g)
    t = torch.tensor([0, 20, 39, 19, 40, -100, 25, 21, 7, 30, 20])
    ws = torch.rand(2, 11, generator=g)  # cotangents of sumexp and the target logit
    got, want = [], []
    for fn, out in (
        (backends.get(bname).linear_cross_entropy_shard, got),
        (linear_cross_entropy_shard_naive, want),
    ):
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        m, s, tl = fn(hr, wr, t, 20, -100)
        ((s * ws[0]).sum() + (tl * ws[1]).sum()).backward()
        out += [m.detach(), s.detach(), tl.detach(), hr.grad, wr.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not got[2][[0, 3, 4, 5, 8]].any()  # target outside [20, 40) or ignored: 0


@pytest.mark.parametrize("bname", BACKENDS)
def test_two_shards_combine_to_the_unsplit_cross_entropy(bname):
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(9, 8, generator=g), torch.randn(30, 8, generator=g) * 2
    t = torch.tensor([0, 14, 15, 29, -100, 3, 22, 7, 16])
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    op = backends.get(bname).linear_cross_entropy_shard
    stats = [op(hr, wr[i * 15 : (i + 1) * 15], t, i * 15) for i in range(2)]
    top = torch.maximum(stats[0][0], stats[1][0])
    lse = top + torch.log(sum(s * torch.exp(m - top) for m, s, _ in stats))
    counted = t != -100
    loss = (lse - stats[0][2] - stats[1][2])[counted].mean()
    loss.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.T, t)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(hr.grad.double(), hd.grad, rtol=0.0, atol=1e-6 * float(hd.grad.abs().max()))
    torch.testing.assert_close(wr.grad.double(), wd.grad, rtol=0.0, atol=1e-6 * float(wd.grad.abs().max()))


def test_bad_arguments_are_one_line():
    op = backends.get("reference").linear_cross_entropy_shard
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"^vocab_start: expected an int >= 0, got -1$"):
        op(h, w, t, -1)
    with pytest.raises(ValueError, match=r"^weight: expected shape \[V >= 1, D=4\]"):
        op(h, w[:0], t, 0)

"""topk: kernels_ascend.topk (threshold search + rank counting, no tl.sort) under triton-ascend's
interpreter."""

from __future__ import annotations

import torch

from kernels_ascend.topk import BLOCK_C, SMALL_ROW

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same(got, want):
    """Indices equal; values equal bit for bit (a -0.0 stays -0.0) except NaN payloads: torch's CPU gather,
    which the reference uses, rewrites a bf16 NaN (0x7FC0 -> 0xFFFF)."""
    (v, i), (rv, ri) = got, want
    assert torch.equal(i, ri)
    nan = v.isnan()
    assert torch.equal(nan, rv.isnan())
    assert torch.equal(v.view(BITS[v.dtype])[~nan], rv.view(BITS[rv.dtype])[~nan])


def test_ties_nan_and_lengths_match_reference_bitwise(backend, reference):
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randint(-3, 4, (5, 70), generator=g).to(dt)  # many exact ties
        x[0, 5] = x[0, 9] = float("nan")
        x[1] = float("-inf")
        x[2, 3] = -0.0
        lengths = torch.tensor([70, 50, 0, 3, 69])
        for k in (1, 8, 75):
            for lens in (None, lengths):
                assert_same(backend.topk(x, k, lens), reference.topk(x, k, lens))


def adversarial_rows(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows longer than two tiles (not a tile multiple) that stress the threshold search and the
    tie selection; lengths around the small-row bound and k."""
    c = 2 * BLOCK_C + 37
    x = torch.randint(-2, 3, (15, c), generator=g).float()  # ties everywhere
    x[0] = 1.0  # all equal: every key is the threshold
    # all NaN, of both signs and several payloads
    nan_bits = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, 0x7FC00123], dtype=torch.int32)
    x[1] = nan_bits.view(torch.float32)[torch.randint(0, 4, (c,), generator=g)]
    x[2] = float("-inf")
    x[2, torch.randint(0, c, (50,), generator=g)] = float("nan")
    x[2, torch.randint(0, c, (20,), generator=g)] = float("inf")
    x[3] = torch.where(torch.rand(c, generator=g) < 0.5, -0.0, 0.0)  # signed zeros tie
    x[3, torch.randint(0, c, (30,), generator=g)] = 1.0
    x[4] = -1.0  # threshold ties straddling the tile boundary: 20 above, then ties from column 2040 on
    x[4, torch.randperm(2000, generator=g)[:20]] = 5.0
    x[4, BLOCK_C - 8 : BLOCK_C + 60] = 2.0
    x[4, c - 20 :] = 2.0
    x[5] = torch.randn(c, generator=g)
    x[6] = x[5].abs().neg()  # every key negative: the sign step answers "no"
    lengths = torch.tensor([c, c, c, c, c, 3000, 3000, 0, 1, SMALL_ROW, SMALL_ROW + 1, 300, 299, c - 1, c])
    return x, lengths


def test_threshold_search_edges_match_reference_bitwise(backend, reference):
    g = torch.Generator().manual_seed(1)
    x32, lengths = adversarial_rows(g)
    # k = 300 > SMALL_ROW: ranked in several tiles; == one length, > another. fp16 / bf16 skip low key bits.
    for dt, k in ((torch.float32, 1), (torch.float32, 300), (torch.bfloat16, 300), (torch.float16, 300)):
        x = x32.to(dt)
        # the last row: adjacent values of the dtype, the largest once and every other twice, so the 300th
        # largest has an odd last bit and ties with the 301st
        base = x[0, 0].view(BITS[dt])  # 1.0: an even bit pattern
        x[-1] = (base + (torch.randperm(x.shape[1], generator=g) + 2).to(base.dtype) // 2).view(dt)
        assert_same(backend.topk(x, k, lengths), reference.topk(x, k, lengths))
    assert_same(backend.topk(x32[:6], 64), reference.topk(x32[:6], 64))  # no lengths

"""topk: kernels_ascend.topk (rank counting, no tl.sort) under triton-ascend's interpreter."""

from __future__ import annotations

import torch


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
                v, i = backend.topk(x, k, lens)
                rv, ri = reference.topk(x, k, lens)
                assert torch.equal(i, ri), (dt, k)
                assert torch.equal(v.float().nan_to_num(9.0), rv.float().nan_to_num(9.0))

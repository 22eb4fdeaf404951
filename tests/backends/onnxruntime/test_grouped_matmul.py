"""grouped_matmul on ONNX Runtime: the Loop over experts rebuilds rows in order, empty experts and
an empty batch included; quantized variants are bitwise the per-expert GEMMs."""

from __future__ import annotations

import pytest
import torch

from backends.reference.w4a8_matmul import pack_int4


def _offsets(counts, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=dtype)


@pytest.mark.parametrize("counts", [[3, 0, 4, 0], [0, 0, 0], [0, 5]])
def test_variants_with_empty_experts(be, ref, no_fallback, counts):
    g = torch.Generator().manual_seed(10)
    e, n, k, m = len(counts), 6, 32, sum(counts)
    offs = _offsets(counts, torch.int64)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(e, n, k, generator=g)
    torch.testing.assert_close(be.grouped_matmul(x, w, offs), ref.grouped_matmul(x, w, offs))
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    x_scale = torch.rand(m, generator=g)
    w_q = torch.randint(-128, 128, (e, n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(e, n, generator=g)
    assert torch.equal(
        be.grouped_matmul(x_q, w_q, offs, x_scale, w_scale, out_dtype=torch.bfloat16),
        ref.grouped_matmul(x_q, w_q, offs, x_scale, w_scale, out_dtype=torch.bfloat16),
    )
    w4 = pack_int4(torch.randint(-8, 8, (e, n, k), generator=g))
    s4 = torch.rand(e, n, 2, generator=g)
    assert torch.equal(
        be.grouped_matmul(x_q, w4, offs, x_scale, s4, 16, torch.float32),
        ref.grouped_matmul(x_q, w4, offs, x_scale, s4, 16, torch.float32),
    )
    no_fallback(ref_calls_allowed=3 + 2 * sum(1 for c in counts if c))

"""dynamic_quant_int8 on ONNX Runtime: bitwise the reference, half-to-even ties included."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitwise_with_half_even_ties_and_zero_rows(be, ref, no_fallback, dtype):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(7))
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: x/scale lands exactly on .5
    x[0, 4:] = 0
    x[1] = 0
    x = x.to(dtype)
    q, s = be.dynamic_quant_int8(x)
    rq, rs = ref.dynamic_quant_int8(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert q[0, :4].tolist() == [127, 0, 2, -2] and not q[1].any()
    no_fallback(ref_calls_allowed=1)

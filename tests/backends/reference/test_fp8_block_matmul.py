"""fp8_block_matmul / fp8_grouped_matmul (SPEC 7.2, 7.3) restated from DeepGEMM's test reference
(dequantize both operands, one matmul) and DeepSeek's `fp8_gemm` (per-128 promotion)."""

from __future__ import annotations

import pytest
import torch

from backends.reference.fp8_block_matmul import fp8_block_matmul
from backends.reference.fp8_format import quantize_weight_blocks
from backends.reference.fp8_grouped_matmul import fp8_grouped_matmul
from backends.reference.fp8_quant_group import fp8_quant_group


def dequant_matmul_fp64(x_q, x_scale, w_q, w_s):
    """DeepGEMM tests: ref = (x_fp8 * sf_x) @ (w_fp8 * sf_w)^T, here in fp64; plus sum |terms| per output."""
    m, k = x_q.shape
    n = w_q.shape[0]
    xs = x_scale.double().repeat_interleave(128, 1)[:, :k]
    ws = w_s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    a, b = x_q.double() * xs, w_q.double() * ws
    return a @ b.T, a.abs() @ b.abs().T


def fp8_inputs(g, m, n, k):
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.05
    x_q, x_s = fp8_quant_group(x, 128, 1e-4, False)
    w_q, w_s = quantize_weight_blocks(w)
    return x, w, x_q, x_s, w_q, w_s


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (5, 200, 300), (33, 130, 129), (4, 7, 1000)])
def test_matches_dequantized_matmul(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, x_q, x_s, w_q, w_s = fp8_inputs(g, m, n, k)
    out = fp8_block_matmul(x_q, x_s, w_q, w_s, None, torch.float32)
    ref, mag = dequant_matmul_fp64(x_q, x_s, w_q, w_s)
    # the reference rounds each block dot and each promotion step to fp32: a few ulps of the magnitude
    kb = -(-k // 128)
    assert ((out.double() - ref).abs() <= (3 * kb + 1) * 2.0**-24 * mag).all()
    # and FP8 quantization itself against the unquantized fp32 GEMM: DeepGEMM's calc_diff < 1e-3
    # (a statistical bound: only meaningful over enough outputs)
    if m * n < 128:
        return
    full = x.double() @ w.double().T
    diff = 1 - 2 * (out.double() * full).sum() / (out.double() ** 2 + full**2).sum()
    assert diff < 1e-3


def test_scales_promote_per_k_block():
    # two K blocks whose scales differ by 2^20: a kernel that applied one scale to the whole K would be off
    x_q = torch.ones(1, 256).to(torch.float8_e4m3fn)
    w_q = torch.ones(1, 256).to(torch.float8_e4m3fn)
    x_s = torch.tensor([[1.0, 2.0**-20]])
    w_s = torch.tensor([[2.0, 3.0]])
    out = fp8_block_matmul(x_q, x_s, w_q, w_s, torch.tensor([1.0]), torch.float32)
    assert out.item() == 128 * 2.0 + 128 * 3.0 * 2.0**-20 + 1.0


def test_grouped_rows_match_per_expert_gemm():
    g = torch.Generator().manual_seed(3)
    k, n = 256, 160
    x = torch.randn(9, k, generator=g)
    x_q, x_s = fp8_quant_group(x, 128, 1e-4, True)
    ws = [quantize_weight_blocks(torch.randn(n, k, generator=g) * 0.1) for _ in range(3)]
    w_q = torch.stack([w for w, _ in ws])
    w_s = torch.stack([s for _, s in ws])
    offs = torch.tensor([0, 4, 4, 9])
    out = fp8_grouped_matmul(x_q, x_s, w_q, w_s, offs, torch.bfloat16)
    for e, (a, b) in enumerate([(0, 4), (4, 4), (4, 9)]):
        if a < b:
            want = fp8_block_matmul(x_q[a:b], x_s[a:b], w_q[e], w_s[e], None, torch.bfloat16)
            assert torch.equal(out[a:b], want)

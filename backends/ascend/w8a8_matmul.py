"""ascend backend: w8a8_matmul (SPEC 2.6) -> torch_npu.npu_quant_matmul (vllm-ascend's W8A8_DYNAMIC linear).

x2 is k-major, so the adapter passes w_q^T [K, N]; `scale` = w_scale [N], `pertoken_scale` = x_scale
[M], bias as fp32. The operator caps both last dims at 65535: N is split into column blocks (vllm-ascend
splits wq_b the same way). Output dtypes are the A2/A3 table's: bf16 (any float bias) and fp16 (no float
bias). fp32 output, fp16 with a float bias and K > 65535 go to kernels_ascend.w8a8_matmul (bitwise the
reference). The operator's epilogue multiplies by the channel scale before the token scale (the
reference does the opposite): up to 1 ulp of fp32 before the cast.
Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
"""

from __future__ import annotations

import torch

from backends.ascend._provider import BATCH_INVARIANT, QMM_MAX_LAST_DIM, OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.ops import FLOATS

OP = "npu_quant_matmul"


def operator_reasons(x_q: torch.Tensor, bias, out_dtype) -> list[str]:
    why = []
    if x_q.shape[1] > QMM_MAX_LAST_DIM:
        why.append(f"K={x_q.shape[1]} > {QMM_MAX_LAST_DIM} ({OP}'s last-dim limit)")
    if out_dtype == torch.float32:
        why.append("float32 output is not in the A2/A3 table")
    if out_dtype == torch.float16 and bias is not None:
        why.append("float16 output with a float bias is not in the A2/A3 table")
    return why


def impl(provider: OpsProvider) -> OpImpl:
    def w8a8_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
        if operator_reasons(x_q, bias, out_dtype):
            from kernels_ascend.w8a8_matmul import w8a8_matmul as kernel

            provider.record("w8a8_matmul", provider.kernel_label("w8a8_matmul"))
            return kernel(x_q, x_scale, w_q, w_scale, bias, out_dtype)
        provider.record("w8a8_matmul", provider.label(OP))
        n = w_q.shape[0]
        parts = []
        for c0 in range(0, n, QMM_MAX_LAST_DIM):
            c = slice(c0, min(c0 + QMM_MAX_LAST_DIM, n))
            parts.append(
                provider.call(
                    OP,
                    x_q,
                    w_q[c].T.contiguous(),
                    w_scale[c].contiguous(),
                    pertoken_scale=x_scale,
                    bias=None if bias is None else bias[c].float(),
                    output_dtype=out_dtype,
                )
            )
        if not parts:
            return torch.empty((x_q.shape[0], 0), dtype=out_dtype, device=x_q.device)
        return torch.cat(parts, dim=1)

    return OpImpl(
        w8a8_matmul,
        OpCaps(
            FLOATS,
            batch_invariant=BATCH_INVARIANT,
            limits={
                "operator": "bf16 / fp16 (no float bias) output, "
                "K <= 65535, N split in blocks of 65535; "
                "otherwise the kernel"
            },
        ),
    )

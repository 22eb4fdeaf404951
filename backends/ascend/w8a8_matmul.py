"""ascend backend: w8a8_matmul (SPEC 2.6) -> torch_npu.npu_quant_matmul (vllm-ascend's W8A8_DYNAMIC linear).

x2 is k-major, so the adapter passes w_q^T [K, N] (contiguous for a weight `prepare`d K-major; an
unprepared one is transposed per call and counted in relayouts); `scale` = w_scale [N],
`pertoken_scale` = x_scale [M], bias as fp32. The operator caps both last dims at 65535: N is split
into column blocks (vllm-ascend splits wq_b the same way). Output dtypes are the A2/A3 table's: bf16
(any float bias) and fp16 (no float
bias). fp32 output, fp16 with a float bias and K > 65535 go to kernels_ascend.w8a8_matmul (bitwise the
reference). The operator's epilogue multiplies by the channel scale before the token scale (the
reference does the opposite): up to 1 ulp of fp32 before the cast.
Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6)
"""

from __future__ import annotations

import torch

from backends.ascend._prepared import k_major
from backends.ascend._provider import BATCH_INVARIANT, QMM_MAX_LAST_DIM, OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS

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


def column_blocks(n: int) -> list[slice]:
    return [slice(c0, min(c0 + QMM_MAX_LAST_DIM, n)) for c0 in range(0, n, QMM_MAX_LAST_DIM)]


def k_major_blocks(provider: OpsProvider, w_q: torch.Tensor) -> list[torch.Tensor]:
    """x2 for each column block: contiguous [K, Nc] int8. A prepared weight is used in place (one block)
    or through its stored blocks (N > 65535); anything else is re-laid out for this call, counted."""
    blocks = provider.forms.get((w_q,))
    if blocks is not None:
        return blocks
    blocks = [w_q[c].T for c in column_blocks(w_q.shape[0])]
    if all(b.is_contiguous() for b in blocks):
        return blocks
    provider.relayouts["w8a8_matmul"] += 1
    return [b.contiguous() for b in blocks]


def impl(provider: OpsProvider) -> OpImpl:
    def w8a8_matmul(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16):
        if operator_reasons(x_q, bias, out_dtype):
            from kernels_ascend.w8a8_matmul import w8a8_matmul as kernel

            provider.record("w8a8_matmul", provider.kernel_label("w8a8_matmul"))
            return kernel(x_q, x_scale, w_q, w_scale, bias, out_dtype)  # any strides: no re-layout
        provider.record("w8a8_matmul", provider.label(OP))
        parts = [
            provider.call(
                OP,
                x_q,
                x2,
                w_scale[c].contiguous(),
                pertoken_scale=x_scale,
                bias=None if bias is None else bias[c].float(),
                output_dtype=out_dtype,
            )
            for c, x2 in zip(column_blocks(w_q.shape[0]), k_major_blocks(provider, w_q), strict=True)
        ]
        if not parts:
            return torch.empty((x_q.shape[0], 0), dtype=out_dtype, device=x_q.device)
        return torch.cat(parts, dim=1)

    def prepare(weights: dict) -> dict:
        """w_q stored K-major (x2 = w_q.T contiguous); past 65535 columns its blocks kept beside it."""
        out = dict(weights)
        if "w_q" in out:
            out["w_q"] = k_major(out["w_q"])
            if out["w_q"].shape[0] > QMM_MAX_LAST_DIM:
                w = out["w_q"]
                provider.forms.put((w,), [w[c].T.contiguous() for c in column_blocks(w.shape[0])])
        return out

    return OpImpl(
        w8a8_matmul,
        OpCaps(
            FLOATS,
            batch_invariant=BATCH_INVARIANT,
            notes={
                "operator": "bf16 / fp16 (no float bias) output, "
                "K <= 65535, N split in blocks of 65535; "
                "otherwise the kernel"
            },
        ),
        prepare,
    )

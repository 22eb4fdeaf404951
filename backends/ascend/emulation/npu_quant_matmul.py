"""EMULATION of `torch_npu.npu_quant_matmul` for the W8A8 per-token form (torch_npu 2.14 docs).

Documented semantics: `out = (x1 @ x2) * scale * pertoken_scale + bias` with x1 int8 `[m, k]`,
x2 int8 `[k, n]` (note: k-major, not the `[n, k]` of a torch Linear), int32 accumulation, scale
`[n]` or `[1]` fp32/bf16, pertoken_scale fp32 `[m]`; the epilogue is fp32 in the documented order
(scale first, then pertoken_scale, then bias) and the result is cast to `output_dtype`.

Limits enforced: x1/x2 int8, 2-D here, last dims <= 65535; output_dtype bf16 or fp16 (the A2/A3
combination table; int8/int32 outputs, int64 scales from npu_trans_quant_param and packed int4 are
not emulated); a float bias is documented for bf16 output only (fp16 output: int32 bias).
"""

from __future__ import annotations

import torch

from backends.ascend._soc import QMM_MAX_LAST_DIM
from backends.ascend.emulation._checks import NotEmulated, need, need_dtype

OP = "npu_quant_matmul"


def npu_quant_matmul(
    x1,
    x2,
    scale,
    *,
    offset=None,
    pertoken_scale=None,
    bias=None,
    output_dtype=None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes=None,
    y_scale=None,
):
    if output_dtype not in (torch.bfloat16, torch.float16):
        raise NotEmulated(f"{OP}: output_dtype={output_dtype} (emulated: bfloat16, float16)")
    if offset is not None or group_sizes is not None or y_scale is not None or scale.dtype == torch.int64:
        raise NotEmulated(f"{OP}: offset / group_sizes / y_scale / int64 scale")
    need_dtype(OP, "x1", x1, (torch.int8,))
    need_dtype(OP, "x2", x2, (torch.int8,))
    need(
        x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
        OP,
        "x2",
        "[k, n] with k as x1 [m, k]",
        f"{list(x1.shape)} @ {list(x2.shape)}",
    )
    m, k = x1.shape
    n = x2.shape[1]
    need(k <= QMM_MAX_LAST_DIM and n <= QMM_MAX_LAST_DIM, OP, "x1/x2", "last dims <= 65535", (k, n))
    need_dtype(OP, "scale", scale, (torch.float32, torch.bfloat16))
    need(tuple(scale.shape) in ((n,), (1,)), OP, "scale", f"[{n}] or [1]", list(scale.shape))
    need(
        isinstance(pertoken_scale, torch.Tensor)
        and pertoken_scale.dtype == torch.float32
        and tuple(pertoken_scale.shape) == (m,),
        OP,
        "pertoken_scale",
        f"float32 [{m}]",
        None if pertoken_scale is None else f"{pertoken_scale.dtype} {list(pertoken_scale.shape)}",
    )
    if bias is not None:
        ok = (
            (torch.int32, torch.bfloat16, torch.float32) if output_dtype == torch.bfloat16 else (torch.int32,)
        )
        need_dtype(OP, "bias", bias, ok)
        need(tuple(bias.shape) == (n,), OP, "bias", f"[{n}]", list(bias.shape))
    acc = (x1.double() @ x2.double()).to(torch.int64)  # exact int32 accumulator
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    out = acc.float() * scale.float() * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)

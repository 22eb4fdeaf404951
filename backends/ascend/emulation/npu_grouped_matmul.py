"""EMULATION of `torch_npu.npu_grouped_matmul` in its MoE form (torch_npu 2.14 docs, op-plugin A8W4 golden).

MoE form emulated: one x `[M, K]`, one 3-D weight `[E, K, N]` (k-major), `split_item` 2 or 3 (one
output), `group_type=0` (groups along M), `group_list` int64 `[E]`: `group_list_type=0` cumulative
row ends, `1` per-group counts. Rows after the last group are not written (emulated as zeros).

Variants (chosen by dtypes, as the operator does):
- float: x and weight bf16/fp16; out = x @ w in fp32 accumulation, cast to x's dtype.
- W8A8: x int8, weight int8, `scale` `[E, N]` fp32/bf16, `per_token_scale` `[M]` fp32,
  `output_dtype` bf16/fp16: out = (x @ w) * scale[e] * per_token_scale.
- W4A8: x int8, weight int32 `[E, K, N/8]` holding eight signed int4 along N (element 8j+i in bits
  4i..4i+3), `scale` int64 `[E, N]` carrying the fp32 bit pattern, `bias` fp32 `[E, N]` (msModelSlim's
  scale_bias = 8 * sum_k w * scale), `per_token_scale` `[M]`, output bf16/fp16. The cube splits each
  int8 activation into int4 halves, x = 16*hi + lo + 8 with hi = x >> 4, lo = (x & 15) - 8:
      out = (16 * (hi @ w) * scale + (lo @ w) * scale + bias) * per_token_scale
  so without the caller's scale_bias the result is off by 8 * sum_k w * scale.
Limits enforced: <= 1024 groups, K and N < 65536, group_list monotone and within M.
"""

from __future__ import annotations

import torch

from backends.ascend._soc import GMM_MAX_DIM, GMM_MAX_GROUPS
from backends.ascend.emulation._checks import NotEmulated, need, need_dtype

OP = "npu_grouped_matmul"


def unpack_int4_along_n(w: torch.Tensor) -> torch.Tensor:
    """int32 [..., N/8] (element 8j+i in bits 4i..4i+3, two's complement) -> int8 [..., N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (w[..., None] >> shifts) & 0xF  # arithmetic shift, then mask
    nib = torch.where(nib >= 8, nib - 16, nib).to(torch.int8)
    return nib.flatten(-2)


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() @ b.double()).to(torch.int64)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    if not (isinstance(x, list) and len(x) == 1 and isinstance(weight, list) and len(weight) == 1):
        raise NotEmulated(
            f"{OP}: multi-tensor x/weight lists (emulated: the MoE form, one x and one 3-D weight)"
        )
    if (
        split_item not in (2, 3)
        or group_type != 0
        or act_type != 0
        or offset is not None
        or antiquant_scale is not None
        or activation_input is not None
    ):
        raise NotEmulated(
            f"{OP}: split_item={split_item}, group_type={group_type}, act_type={act_type}, "
            "offset/antiquant/activation inputs"
        )
    x, w = x[0], weight[0]
    need(
        x.dim() == 2 and w.dim() == 3,
        OP,
        "x/weight",
        "x [M, K] and weight [E, K, N]",
        f"{list(x.shape)}, {list(w.shape)}",
    )
    m, k = x.shape
    e = w.shape[0]
    need(w.shape[1] == k, OP, "weight", f"[E, K={k}, N]", list(w.shape))
    need(e <= GMM_MAX_GROUPS, OP, "weight", f"<= {GMM_MAX_GROUPS} groups", e)
    need(
        isinstance(group_list, torch.Tensor)
        and group_list.dtype == torch.int64
        and tuple(group_list.shape) == (e,),
        OP,
        "group_list",
        f"int64 [E={e}]",
        None if group_list is None else f"{group_list.dtype} {list(group_list.shape)}",
    )
    need(group_list_type in (0, 1), OP, "group_list_type", "0 (cumulative) or 1 (counts)", group_list_type)
    gl = group_list.tolist()
    ends = gl if group_list_type == 0 else [sum(gl[: i + 1]) for i in range(e)]
    need(
        all(v >= 0 for v in gl)
        and all(b >= a for a, b in zip([0] + ends, ends, strict=False))
        and (not ends or ends[-1] <= m),
        OP,
        "group_list",
        f"{'cumulative ends' if group_list_type == 0 else 'counts'} within M={m}",
        gl,
    )
    starts = [0] + ends[:-1]

    if x.dtype in (torch.bfloat16, torch.float16):
        need(w.dtype == x.dtype, OP, "weight", f"dtype {x.dtype} (as x)", w.dtype)
        n = w.shape[2]
        need(k < GMM_MAX_DIM and n < GMM_MAX_DIM, OP, "x/weight", "K, N < 65536", (k, n))
        out = torch.zeros(m, n, dtype=x.dtype)
        for g in range(e):
            out[starts[g] : ends[g]] = (x[starts[g] : ends[g]].float() @ w[g].float()).to(x.dtype)
        return [out]
    need_dtype(OP, "x", x, (torch.int8,))
    need(
        output_dtype in (torch.bfloat16, torch.float16),
        OP,
        "output_dtype",
        "bfloat16 or float16",
        output_dtype,
    )
    need(
        isinstance(per_token_scale, list)
        and len(per_token_scale) == 1
        and per_token_scale[0].dtype == torch.float32
        and tuple(per_token_scale[0].shape) == (m,),
        OP,
        "per_token_scale",
        f"[float32 [M={m}]]",
        per_token_scale,
    )
    pts = per_token_scale[0]
    need(isinstance(scale, list) and len(scale) == 1, OP, "scale", "a one-tensor list", scale)
    sc = scale[0]
    if w.dtype == torch.int8:  # W8A8
        n = w.shape[2]
        need_dtype(OP, "scale", sc, (torch.float32, torch.bfloat16))
        need(tuple(sc.shape) == (e, n), OP, "scale", f"[E={e}, N={n}]", list(sc.shape))
        need(bias is None, OP, "bias", "None (int32 bias not emulated)", "a tensor")
        out = torch.zeros(m, n, dtype=output_dtype)
        for g in range(e):
            r = slice(starts[g], ends[g])
            out[r] = (_int_mm(x[r], w[g]).float() * sc[g].float() * pts[r, None]).to(output_dtype)
        return [out]
    need_dtype(OP, "weight", w, (torch.int32,))  # W4A8, packed along N
    n = w.shape[2] * 8
    need(k < GMM_MAX_DIM and n < GMM_MAX_DIM, OP, "x/weight", "K, N < 65536", (k, n))
    need_dtype(OP, "scale", sc, (torch.int64,))
    need(tuple(sc.shape) == (e, n), OP, "scale", f"int64 [E={e}, N={n}] (fp32 bits)", list(sc.shape))
    need(
        isinstance(bias, list)
        and len(bias) == 1
        and bias[0].dtype == torch.float32
        and tuple(bias[0].shape) == (e, n),
        OP,
        "bias",
        f"[float32 [E={e}, N={n}]] (scale_bias)",
        bias,
    )
    scale_f = (sc & 0xFFFFFFFF).to(torch.int32).view(torch.float32)  # low 32 bits = fp32 pattern
    hi = torch.div(x, 16, rounding_mode="floor")  # x >> 4
    lo = (x.to(torch.int16) & 0xF) - 8
    out = torch.zeros(m, n, dtype=output_dtype)
    for g in range(e):
        r = slice(starts[g], ends[g])
        wg = unpack_int4_along_n(w[g])  # [K, N] int8
        mm = (
            16 * _int_mm(hi[r], wg).float() * scale_f[g]
            + _int_mm(lo[r], wg).float() * scale_f[g]
            + bias[0][g]
        )
        out[r] = (mm * pts[r, None]).to(output_dtype)
    return [out]

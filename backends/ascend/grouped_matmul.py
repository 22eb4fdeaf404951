"""ascend backend: grouped_matmul (SPEC 2.8) -> torch_npu.npu_grouped_matmul in its MoE form
(one x, one 3-D weight, split_item=2, group_type=0), as vllm-ascend's fused MoE calls it.

Conversions: weights [E, N, K] -> k-major [E, K, N] (a view of a weight `prepare`d K-major; an
unprepared one is transposed per call, counted in relayouts["grouped_matmul"]); group_offsets [E+1] ->
`group_list` int64 of cumulative row ends (group_list_type=0; `GROUP_LIST_TYPE=1`: per-expert counts).
- float (bf16/fp16): weights transposed.
- W8A8: int8 weights transposed, `scale` = w_scale [E, N], `per_token_scale` = [x_scale].
- W4A8 per-channel: weights repacked (once by `prepare`, kept beside the weight; else per call, counted)
  to int32 [E, K, N/8] (eight int4 along N), N padded to a multiple of 8, `scale` = fp32 bits in
  int64, `bias` = scale_bias = 8 * sum_k w * scale, which the cube needs because it splits each int8
  activation into int4 halves (x = 16 hi + lo + 8).
- everything else (fp32, per-group W4A8, which vllm-ascend also rejects for MoE, fp32 output, over the
  limits): one kernels_ascend GEMM per non-empty expert.
The float variant is differentiable in x and w (`backward`): dx[rows of e] = dy @ w[e] through the
operator, whose k-major weight [E, K', N'] an unprepared w [E, N, K] already is (no copy), else per
expert; dw[e] = dy[rows of e]^T @ x[rows of e] by one kernels_ascend GEMM per non-empty expert on strided
views (the operator's MoE form groups along M only, so the offsets are read on the host, as the
per-expert forward route does).
In the layout-invariant mode (SPEC 12) the operator does not run (it has no exact mode): float experts are
one exact product each on the "ascend" engine (kernels_ascend.invariant_gemm: int8 digit products in
int32), any row count giving the same bits; quantized ones take the per-expert kernels (int8 x int8 ->
int32, exact in any order, then each element's fp32 epilogue).
Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._prepared import k_major
from backends.ascend._provider import BATCH_INVARIANT, GMM_MAX_DIM, GMM_MAX_GROUPS, OpsProvider
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.invariant import engine as invariant
from backends.moe.dispatch import zero_padding_rows

OP = "npu_grouped_matmul"
GROUP_LIST_TYPE = 0  # 0: cumulative ends; 1: per-group counts


def group_list(group_offsets: torch.Tensor) -> torch.Tensor:
    offs = group_offsets.to(torch.int64)
    return (offs[1:] if GROUP_LIST_TYPE == 0 else offs[1:] - offs[:-1]).contiguous()


def _gmm(provider: OpsProvider, x, weight, group_offsets, **kw) -> torch.Tensor:
    """The operator leaves the rows past the last group unwritten: zeroed here (SPEC 2.8's padding)."""
    out = provider.call(
        OP,
        [x],
        [weight],
        group_list=group_list(group_offsets),
        split_item=2,
        group_type=0,
        group_list_type=GROUP_LIST_TYPE,
        **kw,
    )[0]
    return zero_padding_rows(out, group_offsets)


def w4_form(provider: OpsProvider, op: str, key: tuple, w_packed, w_scale) -> tuple:
    """npu_grouped_matmul's int4 form of per-channel W4 weights: the one `prepare` stored for the
    tensors `key`, else repacked for this call (counted in relayouts[op])."""
    form = provider.forms.get(key)
    if form is None:
        provider.relayouts[op] += 1
        form = ad.repack_w4_for_npu(w_packed, w_scale)
    return form


def w4a8_operator(
    provider: OpsProvider, op: str, x, x_scale, w_packed, w_scale, group_offsets, out_dtype, form
):
    """Per-channel W4A8 through the operator: w_packed uint8 [E, N, K//2], w_scale fp32 [E, N], and
    `form` = their npu repack (`w4_form`)."""
    provider.record(op, provider.label(OP) + " (int4 weights repacked)")
    weight, scale_bits, scale_bias, _ = form
    out = _gmm(
        provider,
        x,
        weight,
        group_offsets,
        scale=[scale_bits],
        bias=[scale_bias],
        per_token_scale=[x_scale],
        output_dtype=out_dtype,
    )
    return out[:, : w_packed.shape[1]]


def operator_reasons(x: torch.Tensor, w: torch.Tensor, group_size, out_dtype) -> list[str]:
    """Why npu_grouped_matmul's MoE form cannot serve these inputs ([] if it can)."""
    why = []
    if w.shape[0] > GMM_MAX_GROUPS:
        why.append(f"{w.shape[0]} experts > {GMM_MAX_GROUPS} groups")
    if x.shape[1] >= GMM_MAX_DIM or w.shape[1] >= GMM_MAX_DIM:
        why.append("K or N >= 65536")
    if x.dtype.is_floating_point:
        if x.dtype == torch.float32:
            why.append("float32 x (not in the operator's documented MoE dtype table)")
        if out_dtype not in (None, x.dtype):
            why.append("float variant outputs x's dtype")
        return why
    if out_dtype not in (torch.bfloat16, torch.float16):
        why.append(f"out_dtype {out_dtype} (the quantized forms output bf16/fp16)")
    if w.dtype == torch.uint8 and group_size != x.shape[1]:
        why.append("per-group int4 scales (the int4 path is per-channel)")
    return why


def _per_expert(provider: OpsProvider, x, w, group_offsets, x_scale, w_scale, group_size, out_dtype):
    """Kernel route: one kernels_ascend GEMM per non-empty expert."""
    from kernels_ascend._matmul import matmul
    from kernels_ascend.w4a8_matmul import w4a8_matmul
    from kernels_ascend.w8a8_matmul import w8a8_matmul

    float_x = x.dtype.is_floating_point
    kind = "matmul" if float_x else "w8a8_matmul" if w.dtype == torch.int8 else "w4a8_matmul"
    provider.record("grouped_matmul", provider.kernel_label(kind) + " per expert")
    out_dtype = out_dtype or x.dtype
    out = torch.zeros((x.shape[0], w.shape[1]), dtype=out_dtype, device=x.device)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        if offs[e + 1] == offs[e]:
            continue
        r = slice(offs[e], offs[e + 1])
        if float_x:
            acc = torch.empty((offs[e + 1] - offs[e], w.shape[1]), dtype=torch.float32, device=x.device)
            out[r] = matmul(x[r], w[e].T, acc).to(out_dtype)
        elif w.dtype == torch.int8:
            out[r] = w8a8_matmul(x[r], x_scale[r], w[e], w_scale[e], None, out_dtype)
        else:
            out[r] = w4a8_matmul(x[r], x_scale[r], w[e], w_scale[e], group_size, None, out_dtype)
    return out


def _exact_experts(provider: OpsProvider, x, w, group_offsets, out_dtype) -> torch.Tensor:
    """The mode's float route: out[rows of e] = exact(x[rows of e], w[e]^T), rounded once to out_dtype."""
    provider.record(
        "grouped_matmul", "layout-invariant: " + provider.kernel_label("invariant_gemm") + " per expert"
    )
    return invariant.exact_grouped_matmul(x, w, group_offsets, out_dtype or x.dtype, "ascend")


def k_major_experts(provider: OpsProvider, w: torch.Tensor) -> torch.Tensor:
    """The operator's [E, K, N] weight: a view of a weight `prepare`d K-major, else a copy (counted)."""
    wt = w.transpose(1, 2)
    if not wt.is_contiguous():
        provider.relayouts["grouped_matmul"] += 1
        wt = wt.contiguous()
    return wt


def impl(provider: OpsProvider) -> OpImpl:
    def grouped_matmul(x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None):
        if invariant.active() and x.dtype.is_floating_point:
            return _exact_experts(provider, x, w, group_offsets, out_dtype)
        if invariant.active() or operator_reasons(x, w, group_size, out_dtype):
            return _per_expert(provider, x, w, group_offsets, x_scale, w_scale, group_size, out_dtype)
        if x.dtype.is_floating_point:
            provider.record("grouped_matmul", provider.label(OP))
            return _gmm(provider, x, k_major_experts(provider, w), group_offsets)
        if w.dtype == torch.int8:
            provider.record("grouped_matmul", provider.label(OP))
            return _gmm(
                provider,
                x,
                k_major_experts(provider, w),
                group_offsets,
                scale=[w_scale],
                per_token_scale=[x_scale],
                output_dtype=out_dtype,
            )
        scale = w_scale[:, :, 0]
        form = w4_form(provider, "grouped_matmul", (w, w_scale), w, scale)
        return w4a8_operator(provider, "grouped_matmul", x, x_scale, w, scale, group_offsets, out_dtype, form)

    def backward(args: dict, outputs: tuple, grad_outputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dw) of the float variant; dy is taken in x's dtype (the operator's float form)."""
        from kernels_ascend._matmul import matmul

        x, w, offsets = args["x"], args["w"], args["group_offsets"]
        dy = grad_outputs[0].to(x.dtype)
        if w.is_contiguous() and not operator_reasons(dy, w.transpose(1, 2), None, None):
            provider.record("grouped_matmul.backward", provider.label(OP) + " (dx) + kernels per expert (dw)")
            dx = _gmm(provider, dy, w, offsets)  # w [E, N, K] read as the operator's [E, K'=N, N'=K]
        else:
            provider.record("grouped_matmul.backward", provider.kernel_label("matmul") + " per expert")
            dx = None
        dx_acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if dx is None else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        offs = offsets.tolist()
        for e in range(w.shape[0]):
            if offs[e + 1] == offs[e]:
                continue
            r = slice(offs[e], offs[e + 1])
            matmul(dy[r].T, x[r], dw[e])
            if dx_acc is not None:
                matmul(dy[r], w[e], dx_acc[r])
        return (dx if dx is not None else dx_acc.to(x.dtype)), dw.to(w.dtype)

    def prepare(weights: dict) -> dict:
        """Float / int8 experts stored K-major; per-channel int4 experts (w_scale [E, N, 1]) keep their
        bytes and get their npu_grouped_matmul repack stored beside them."""
        out = dict(weights)
        w, w_scale = out.get("w"), out.get("w_scale")
        if w is None:
            return out
        if w.dtype == torch.uint8:
            if w_scale is not None and w_scale.dim() == 3 and w_scale.shape[2] == 1:
                provider.forms.put((w, w_scale), ad.repack_w4_for_npu(w, w_scale[:, :, 0]))
            return out
        out["w"] = k_major(w)
        return out

    def check(a: dict) -> list[str]:
        if a["w"].dtype == torch.uint8 and a["group_size"] != a["x"].shape[1] and a["group_size"] % 2:
            return [f"group_size {a['group_size']} is odd: a packed byte would straddle two groups"]
        return []

    return OpImpl(
        grouped_matmul,
        OpCaps(
            FLOATS + ("w8a8", "w4a8"),
            batch_invariant=BATCH_INVARIANT,
            check=check,
            differentiable=True,
            layout_invariant=True,  # the mode: exact products per float expert, the quantized kernels
            notes={
                "operator": "bf16/fp16 float or bf16/fp16-output W8A8 / "
                "per-channel W4A8, <= 1024 experts, K, N < 65536; "
                "otherwise kernels per expert"
            },
        ),
        prepare,
        backward=backward,
    )

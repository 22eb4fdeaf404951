"""onnxruntime backend: grouped_matmul -> glm5.grouped_matmul[_w8a8|_w4a8] (functions/grouped_matmul.py):
an ONNX Loop over experts, each expert's rows sliced by group_offsets in-graph."""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.contract.ops import FLOATS
from backends.onnxruntime._session import inference_only, onnx_dtype, run
from backends.onnxruntime.w8a8_matmul import K_REASON, MAX_K


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    group_offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K]; w [E, N, K] (float / int8) or [E, N, K//2] (uint8, packed int4); group_offsets [E+1]
    -> [M, N] out_dtype (default: dtype of x). Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)"""
    out_dtype = out_dtype or x.dtype
    outs = [("out", out_dtype, 2)]
    if x.dtype.is_floating_point:
        inputs = {"x": x, "w": w, "group_offsets": group_offsets}
        (out,) = run("grouped_matmul", "grouped_matmul", inputs, outs, out_dtype=onnx_dtype(out_dtype))
        return out
    if w.dtype == torch.int8 and x.shape[1] == 0:  # ORT leaves K = 0 uninitialised (empty_k_epilogue)
        sizes = torch.diff(group_offsets.long().cpu())
        e = torch.repeat_interleave(torch.arange(w.shape[0]), sizes).to(w_scale.device)
        r = e.numel()  # rows past the last offset are padding: zero
        acc = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
        acc[:r] = acc[:r] * x_scale.float()[:r, None] * w_scale.float()[e]
        return acc.to(out_dtype)
    inputs = {"x": x, "x_scale": x_scale, "w": w, "w_scale": w_scale, "group_offsets": group_offsets}
    if w.dtype == torch.int8:
        (out,) = run("grouped_matmul", "grouped_matmul_w8a8", inputs, outs, out_dtype=onnx_dtype(out_dtype))
    else:
        (out,) = run(
            "grouped_matmul",
            "grouped_matmul_w4a8",
            inputs,
            outs,
            group_size=group_size,
            out_dtype=onnx_dtype(out_dtype),
        )
    return out


def _check(a: dict) -> list[str]:
    return inference_only("x", "w")(a) if a["x"].dtype.is_floating_point else []


LIMITS = (
    Limit("K", max=MAX_K, reason=K_REASON, when=("w8a8",)),
    Limit("group_size", max=MAX_K, reason=K_REASON, when=("w4a8",)),
    Limit("K", min=1, reason="no int4 groups", when=("w4a8",)),
)


# Not batch-invariant: for float inputs ORT's MatMul (MLAS) picks kernels by the row count, so an
# expert's rows run alone may round differently (measured on the conformance subsets).
IMPL = OpImpl(
    grouped_matmul,
    OpCaps(FLOATS + ("w8a8", "w4a8"), limits=LIMITS, check=_check, batch_invariant=False),
)

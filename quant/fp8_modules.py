"""FP8 drop-ins for the model's `nn.Linear` and routed `Experts` (GLM-5-FP8 / DeepSeek-V3 block format),
computing through the backend's FP8 ops (SPEC 7.1-7.3).

Weights are e4m3 with `weight_scale_inv` fp32 multipliers per 128 x 128 block (`[ceil(N/128),
ceil(K/128)]`); activations are quantized per token in 1 x 128 groups on every call (`fp8_quant_group`,
DeepSeek's 1e-4 floor; UE8M0 scales when the checkpoint says `scale_fmt: ue8m0`). Experts keep gate, up
and down as three stacked tensors, because a fused gate|up would break the 128-row blocks whenever the
expert width is not a multiple of 128.

In the layout-invariant mode (SPEC 12) both de-quantize into the mode's exact product instead of the FP8
GEMMs (whose fp32 block sums are a kernel's order): x_deq = x_q * x_scale per 1 x 128 group and W_deq =
W_fp8 * scale_inv per 128 x 128 block, each one fp32 multiply per element, then `exact_matmul` (a linear,
with the plan's row-parallel split as its argument) or the float `grouped_matmul` (experts, which runs it
per expert in the mode).
"""

from __future__ import annotations

import torch
from torch import nn

from backends import Backend
from backends.formats import BLOCK, E4M3, EPS_DEEPSEEK, cdiv, dequantize_weight_blocks, expand_groups
from backends.invariant import engine as invariant
from backends.moe import dispatch as moe
from quant.modules import Fp32Scales

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _scale_shape(n: int, k: int) -> tuple[int, int]:
    return cdiv(n, BLOCK), cdiv(k, BLOCK)


def _groups_dequantized(x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """fp8_quant_group's (e4m3 [M, K], fp32 [M, G]) -> fp32 x_q * x_scale, column k in group k // 128."""
    return x_q.float() * expand_groups(x_scale, x_q.shape[-1])


def _blocks_dequantized(module: nn.Module, proj: str) -> torch.Tensor:
    """W_deq of buffer `proj` and its `<proj>_scale_inv` (fp32, as `dequantize_weight_blocks`). On the CPU
    it is kept on the module (not a buffer: no state_dict entry) with copies of the two buffers it was
    made from, and served while they hold the same values (compared on every use, as the mode's own weight
    grids are: `.data` writes and in-place loads bypass version counters). On a device it is made on every
    call: the comparison would read a flag back to the host."""
    w, s = getattr(module, proj), getattr(module, f"{proj}_scale_inv")
    if w.device.type != "cpu":
        return dequantize_weight_blocks(w, s)
    cache = module.__dict__.setdefault("_dequantized", {})
    entry = cache.get(proj)
    if (
        entry is None
        or entry[0].shape != w.shape
        or entry[1].shape != s.shape
        or not torch.equal(entry[0], w.view(torch.uint8))
        or not torch.equal(entry[1], s)
    ):
        entry = (w.view(torch.uint8).clone(), s.clone(), dequantize_weight_blocks(w, s))
        cache[proj] = entry
    return entry[2]


class FP8Linear(Fp32Scales):
    """y = W x: fp8_quant_group(x) then fp8_block_matmul, output in x's dtype. In the layout-invariant mode:
    exact_matmul(x_deq, W_deq^T) (+ bias in fp32), also split by input columns (the plan's row-parallel)."""

    exact_split_product = True  # in the mode a row-parallel split keeps the unsplit bits (RowSplit)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        backend: Backend,
        bias: bool = False,
        ue8m0: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.backend, self.ue8m0 = (
            in_features,
            out_features,
            backend,
            ue8m0,
        )
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer(
            "weight_scale_inv",
            torch.zeros(*_scale_shape(out_features, in_features), dtype=torch.float32, device=device),
        )
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None
        )

    def use_backend(self, backend: Backend) -> None:
        """Compute with `backend` (the model calls this when its backend is set)."""
        self.backend = backend

    def set_fp8(self, w_q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(w_q)
        self.weight_scale_inv.copy_(scale_inv.float())
        if bias is not None:
            self.bias.copy_(bias.float())

    def dequantized(self) -> torch.Tensor:
        return dequantize_weight_blocks(self.weight.cpu(), self.weight_scale_inv.cpu())

    def parallel_split(self, dim: int, size: int, split) -> None:
        """Keep 1/size of the weight along dim (0: rows, 1: columns) with its 128 x 128 block scales:
        each part must be a whole number of blocks (glm5/parallel/plan.py)."""
        full = self.weight.shape[dim]
        if full % (size * BLOCK):
            raise ValueError(
                f"FP8 block scales: dimension {dim} ({full}) does not split into {size} parts of whole "
                f"{BLOCK}-blocks"
            )
        if dim == 1 and self.bias is not None:
            raise ValueError("bias: an FP8 layer split by input columns cannot keep a bias")
        split("weight", dim)
        split("weight_scale_inv", dim, unit_=1)
        if dim == 0 and self.bias is not None:
            split("bias", 0)
        if dim == 0:
            self.out_features //= size
        else:
            self.in_features //= size

    def forward(self, x: torch.Tensor, split: invariant.RowSplit | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; `split`: the plan's row-parallel split, taken in the layout-invariant mode
        (a split's 128-column groups are the unsplit layer's: parallel_split keeps whole blocks)."""
        shape = x.shape
        xq, xs = self.backend.fp8_quant_group(x.reshape(-1, shape[-1]), BLOCK, EPS_DEEPSEEK, self.ue8m0)
        if invariant.active():
            w = _blocks_dequantized(self, "weight").T
            x_deq = _groups_dequantized(xq, xs)
            if self.bias is None:
                y = invariant.exact_matmul(x_deq, w, x.dtype, split=split, weight=True)
            else:  # fp8_block_matmul's epilogue: the bias added in fp32, one rounding to x's dtype
                y = invariant.exact_matmul(x_deq, w, torch.float32, split=split, weight=True)
                y = (y + self.bias.float()).to(x.dtype)
        else:
            y = self.backend.fp8_block_matmul(
                xq, xs, self.weight, self.weight_scale_inv, self.bias, out_dtype=x.dtype
            )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 128x128 blocks, ue8m0={self.ue8m0}"


class FP8Experts(Fp32Scales):
    """Routed experts with e4m3 weights: gate_proj / up_proj [E, I, D], down_proj [E, D, I], each with its
    `<proj>_scale_inv` [E, ceil(rows/128), ceil(cols/128)]. forward as glm5.core.moe.Experts."""

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        inter: int,
        ue8m0: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n_experts, self.hidden, self.inter, self.ue8m0 = n_experts, hidden, inter, ue8m0
        e, d, i = n_experts, hidden, inter
        for p, (n, k) in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            self.register_buffer(p, torch.zeros(e, n, k, dtype=E4M3, device=device))
            self.register_buffer(
                f"{p}_scale_inv", torch.zeros(e, *_scale_shape(n, k), dtype=torch.float32, device=device)
            )

    def set_fp8(self, e: int, proj: str, w_q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        getattr(self, proj)[e].copy_(w_q)
        getattr(self, f"{proj}_scale_inv")[e].copy_(scale_inv.float())

    def fp8_weight(self, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, proj)[e], getattr(self, f"{proj}_scale_inv")[e]

    def parallel_split(self, dim: int, size: int, split) -> None:
        """Keep 1/size of every expert's intermediate dim (dim -1) with its block scales: each part must
        be a whole number of 128-blocks (glm5/parallel/plan.py)."""
        if dim != -1 or self.inter % (size * BLOCK):
            raise ValueError(
                f"moe_intermediate_size: {self.inter} does not split into {size} parts of whole "
                f"{BLOCK}-blocks (FP8 block scales)"
            )
        for name, tdim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
            split(name, tdim)
            split(f"{name}_scale_inv", tdim)
        self.inter //= size

    def _gemm(self, be: Backend, xq, xs, proj: str, offsets, dtype) -> torch.Tensor:
        return be.fp8_grouped_matmul(
            xq, xs, getattr(self, proj), getattr(self, f"{proj}_scale_inv"), offsets, out_dtype=dtype
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, be: Backend) -> torch.Tensor:
        d = moe.dispatch(ids, self.n_experts)
        return moe.combine(self.rows(x, d, be), w, d).to(x.dtype)

    def rows(self, x: torch.Tensor, d: moe.Dispatch, be: Backend) -> torch.Tensor:
        """Expert outputs [T*k, D] in d's expert-sorted order (glm5.core.moe.Experts.rows)."""
        xq, xs = be.fp8_quant_group(x, BLOCK, EPS_DEEPSEEK, self.ue8m0)  # per-token groups: row order free
        if invariant.active():
            return self._exact_rows(_groups_dequantized(xq, xs)[d.token], d, be, x.dtype)
        xq, xs = xq[d.token], xs[d.token]
        gate_up = torch.cat(
            [self._gemm(be, xq, xs, name, d.offsets, x.dtype) for name in ("gate_proj", "up_proj")], dim=1
        )
        h = be.silu_and_mul(gate_up)  # SPEC 2.10
        hq, hs = be.fp8_quant_group(h, BLOCK, EPS_DEEPSEEK, self.ue8m0)
        return self._gemm(be, hq, hs, "down_proj", d.offsets, x.dtype)

    def _exact_rows(self, x_deq: torch.Tensor, d: moe.Dispatch, be: Backend, dtype) -> torch.Tensor:
        """The layout-invariant mode's rows: de-quantized activations and weights through the float
        grouped_matmul (exact per expert in the mode), activations re-quantized after SwiGLU as above."""

        def gemm(a: torch.Tensor, proj: str) -> torch.Tensor:
            return be.grouped_matmul(a, _blocks_dequantized(self, proj), d.offsets, out_dtype=dtype)

        h = be.silu_and_mul(torch.cat([gemm(x_deq, "gate_proj"), gemm(x_deq, "up_proj")], dim=1))
        return gemm(_groups_dequantized(*be.fp8_quant_group(h, BLOCK, EPS_DEEPSEEK, self.ue8m0)), "down_proj")

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, hidden={self.hidden}, inter={self.inter}, fp8 e4m3 128x128 blocks"

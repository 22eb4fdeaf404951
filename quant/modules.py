"""Quantized drop-ins for the model's `nn.Linear` and routed `Experts`, computing through the backend.

They hold integer weights in the backend contract's layout (SPEC 2.6-2.8): W8A8 int8 [N, K] with an fp32
per-channel scale [N]; W4A8 uint8 [N, K // 2] (two signed int4 per byte along K, even k in the low
nibble; backends/reference/w4a8_matmul.py) with fp32 scales [N, K // group_size]. Activations are
quantized per token on every call with `dynamic_quant_int8`, so a quantized model runs on any backend
that implements SPEC 2.5-2.8.
"""

from __future__ import annotations

import torch
from torch import nn

from backends import Backend
from backends.formats import pack_int4, unpack_int4
from backends.invariant import engine as invariant
from backends.moe import dispatch as moe
from quant import invariant as invariant_mode
from quant.recipe import W4A8, W8A8, Scheme

F32 = torch.float32  # scales and biases are fp32 whatever torch's default dtype (vLLM sets bf16)


class Fp32Scales(nn.Module):
    """A quantized layer's scales and biases are fp32 by the contract. `model.to(dtype)`, `.bfloat16()` or
    `.half()` change the float model's compute dtype; these buffers follow device moves but keep fp32
    (cast to bf16 they would lose bits, and the front door would refuse them)."""

    def _apply(self, fn, recurse=True):
        keep = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == F32}
        super()._apply(fn, recurse)
        for n, old in keep.items():
            new = self._buffers[n]
            if new.dtype != F32:
                self._buffers[n] = old.to(new.device)
        return self


def _pack(q: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    return pack_int4(q) if scheme.name == W4A8 else q.to(torch.int8)


def _unpack(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    return unpack_int4(w) if scheme.name == W4A8 else w


class QuantLinear(Fp32Scales):
    """y = W x through the backend: x [.., K] float -> [.., N] of x's dtype.

    W8A8: dynamic_quant_int8 + w8a8_matmul; W4A8: dynamic_quant_int8 + w4a8_matmul.
    Semantics: backends/reference/w8a8_matmul.py (SPEC 2.6), backends/reference/w4a8_matmul.py (SPEC 2.7)
    In the layout-invariant mode: quant/invariant.py (also split by input columns: the plan's row-parallel).
    """

    exact_split_product = True  # the plan's row-parallel split keeps the mode's bits (quant/invariant.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: Scheme,
        backend: Backend,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if scheme.name not in (W8A8, W4A8):
            raise ValueError(f"scheme: expected W8A8_DYNAMIC or W4A8_DYNAMIC, got {scheme.name!r}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.backend = scheme, backend
        k, n = in_features, out_features
        self.group_size = scheme.group_size or k
        if k % self.group_size:
            raise ValueError(f"group_size: expected a divisor of in_features={k}, got {scheme.group_size}")
        if scheme.name == W4A8:
            self.register_buffer("weight", torch.zeros(n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer(
                "weight_scale", torch.zeros(n, k // self.group_size, dtype=F32, device=device)
            )
        else:
            self.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8, device=device))
            self.register_buffer("weight_scale", torch.zeros(n, dtype=F32, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=F32, device=device) if bias else None)
        self.use_backend(backend)

    @classmethod
    def from_int(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        scheme: Scheme,
        backend: Backend,
        bias: torch.Tensor | None = None,
    ) -> QuantLinear:
        """q int8 [N, K] (int4 values for W4A8), scale fp32 [N, G] -> module."""
        n, k = q.shape
        m = cls(k, n, scheme, backend, bias is not None, q.device)
        m.set_int(q, scale, bias)
        return m

    def set_int(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(_pack(q, self.scheme))
        self.weight_scale.copy_(scale.reshape(self.weight_scale.shape).float())
        if bias is not None:
            self.bias.copy_(bias.float())

    def int_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N, G]) whatever the scheme."""
        return _unpack(self.weight, self.scheme), self.weight_scale.reshape(self.out_features, -1)

    def use_backend(self, backend: Backend) -> None:
        """Compute with `backend`, its weights laid out by it once (`Backend.prepare`); the model calls this
        when its backend is set and after loading."""
        self.backend = backend
        if self.scheme.name == W4A8:
            self._prepared = backend.prepare("w4a8_matmul", w_packed=self.weight, w_scale=self.weight_scale)
        else:
            self._prepared = backend.prepare("w8a8_matmul", w_q=self.weight, w_scale=self.weight_scale)

    def parallel_split(self, dim: int, size: int, split) -> None:
        """Keep 1/size of the [N, K] weight along dim (0: output rows, 1: input columns) and the tensors
        that follow it; `split(name, tensor_dim)` slices one (glm5/parallel/plan.py). A per-channel scale
        stays whole under a column split; a per-group one is split with its columns."""
        if dim == 0:
            for name in ("weight", "weight_scale") + (("bias",) if self.bias is not None else ()):
                split(name, 0)
            self.out_features //= size
        else:
            if self.bias is not None:
                raise ValueError("bias: a quantized layer split by input columns cannot keep a bias")
            split("weight", 1)
            if self.scheme.group_size:
                split("weight_scale", 1)
            self.in_features //= size
            self.group_size = self.scheme.group_size or self.in_features
        self.use_backend(self.backend)

    def forward(self, x: torch.Tensor, split: invariant.RowSplit | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; `split`: the plan's row-parallel split, taken in the layout-invariant
        mode (quant/invariant.py)."""
        if invariant.active():
            return invariant_mode.forward(self, x, split)
        shape = x.shape
        be, w = self.backend, self._prepared
        xq, xs = be.dynamic_quant_int8(x.reshape(-1, shape[-1]))
        if self.scheme.name == W4A8:
            y = be.w4a8_matmul(
                xq, xs, w["w_packed"], w["w_scale"], self.group_size, self.bias, out_dtype=x.dtype
            )
        else:
            y = be.w8a8_matmul(xq, xs, w["w_q"], w["w_scale"], self.bias, out_dtype=x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, {self.scheme.name}, "
            f"group_size={self.group_size}"
        )


class QuantExperts(Fp32Scales):
    """Routed experts with quantized weights: gate and up fused into w13 [E, 2I, D(/2)], w2 [E, D, I(/2)].

    forward(x [T, D], ids int32 [T, k], w fp32 [T, k], be) as glm5.core.moe.Experts: per token quantize, one
    grouped_matmul for gate|up, SwiGLU, re-quantize, grouped_matmul for down, weight and scatter-add.
    Semantics: backends/reference/grouped_matmul.py (SPEC 2.8)
    """

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        inter: int,
        scheme: Scheme,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.n_experts, self.hidden, self.inter, self.scheme = n_experts, hidden, inter, scheme
        e, d, i = n_experts, hidden, inter
        self.gs13 = scheme.group_size or d
        self.gs2 = scheme.group_size or i
        if d % self.gs13 or i % self.gs2:
            raise ValueError(
                f"group_size: expected a divisor of hidden={d} and moe_intermediate={i}, "
                f"got {scheme.group_size}"
            )
        if scheme.name == W4A8:
            self.register_buffer("w13", torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8, device=device))
            self.register_buffer("w13_scale", torch.zeros(e, 2 * i, d // self.gs13, dtype=F32, device=device))
            self.register_buffer("w2", torch.zeros(e, d, i // 2, dtype=torch.uint8, device=device))
            self.register_buffer("w2_scale", torch.zeros(e, d, i // self.gs2, dtype=F32, device=device))
        else:
            self.register_buffer("w13", torch.zeros(e, 2 * i, d, dtype=torch.int8, device=device))
            self.register_buffer("w13_scale", torch.zeros(e, 2 * i, dtype=F32, device=device))
            self.register_buffer("w2", torch.zeros(e, d, i, dtype=torch.int8, device=device))
            self.register_buffer("w2_scale", torch.zeros(e, d, dtype=F32, device=device))

    def set_int(self, e: int, proj: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Expert e's `gate_proj` / `up_proj` / `down_proj`: q int8 [N, K], scale fp32 [N, G]."""
        rows = {
            "gate_proj": slice(0, self.inter),
            "up_proj": slice(self.inter, 2 * self.inter),
            "down_proj": slice(None),
        }[proj]
        w, s = (self.w2, self.w2_scale) if proj == "down_proj" else (self.w13, self.w13_scale)
        w[e, rows] = _pack(q, self.scheme)
        s[e, rows] = scale.reshape(s[e, rows].shape).float()

    def int_weight(self, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N, G]) of expert e's projection."""
        rows = {
            "gate_proj": slice(0, self.inter),
            "up_proj": slice(self.inter, 2 * self.inter),
            "down_proj": slice(None),
        }[proj]
        w, s = (self.w2, self.w2_scale) if proj == "down_proj" else (self.w13, self.w13_scale)
        q = _unpack(w[e, rows], self.scheme)
        return q, s[e, rows].reshape(q.shape[0], -1)

    def parallel_split(self, dim: int, size: int, split) -> None:
        """Keep 1/size of every expert's intermediate dim (dim -1; `split(name, tensor_dim, halves)` slices
        one tensor, glm5/parallel/plan.py): both halves of the fused gate|up, the input columns of down."""
        if dim != -1:
            raise ValueError(f"dim: quantized experts split on their intermediate dim (-1), got {dim}")
        split("w13", 1, 2)
        split("w13_scale", 1, 2)
        split("w2", 2)
        if self.scheme.group_size:
            split("w2_scale", 2)
        self.inter //= size
        self.gs2 = self.scheme.group_size or self.inter
        self.__dict__.pop("_prepared", None)  # laid out again on the next call

    def use_backend(self, backend: Backend) -> None:
        """Lay the expert weights out for `backend` once (`Backend.prepare`); see QuantLinear.use_backend."""
        gs = self.scheme.name == W4A8
        self._prepared = (
            backend.key,
            backend.prepare(
                "grouped_matmul", w=self.w13, w_scale=self.w13_scale, group_size=self.gs13 if gs else None
            ),
            backend.prepare(
                "grouped_matmul", w=self.w2, w_scale=self.w2_scale, group_size=self.gs2 if gs else None
            ),
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, be: Backend) -> torch.Tensor:
        d = moe.dispatch(ids, self.n_experts)
        return moe.combine(self.rows(x, d, be), w, d).to(x.dtype)

    def rows(self, x: torch.Tensor, d: moe.Dispatch, be: Backend) -> torch.Tensor:
        """Expert outputs [T*k, D] in d's expert-sorted order (glm5.core.moe.Experts.rows)."""
        if getattr(self, "_prepared", (None,))[0] != be.key:
            self.use_backend(be)  # a backend these experts have not been prepared for: once, not per call
        _, p13, p2 = self._prepared
        w4 = self.scheme.name == W4A8
        # per-token scales do not depend on row order: quantize the T rows once, then gather
        xq, xs = be.dynamic_quant_int8(x)
        xq, xs = xq[d.token], xs[d.token]
        h13 = be.grouped_matmul(
            xq, p13["w"], d.offsets, xs, p13["w_scale"], self.gs13 if w4 else None, out_dtype=x.dtype
        )
        h = be.silu_and_mul(h13)  # [gate | up] side by side: SPEC 2.10
        hq, hs = be.dynamic_quant_int8(h)
        return be.grouped_matmul(
            hq, p2["w"], d.offsets, hs, p2["w_scale"], self.gs2 if w4 else None, out_dtype=x.dtype
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.n_experts}, hidden={self.hidden}, inter={self.inter}, {self.scheme.name}, "
            f"group_size={self.scheme.group_size}"
        )

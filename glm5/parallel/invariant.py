"""The layout-invariant mode (SPEC 12): one switch, for serving and training, under which the same weights
and tokens give the same bits of every logit, indexer top-k set and MoE routing decision at any tensor-
or expert-parallel layout, batch size and prefill/decode split, on a backend that declares
`layout_invariant` for its ops (the reference, cpu, cuda and ascend backends).

    with layout_invariant(model.backend):
        logits = model(ids).logits

Inside, a TorchDispatchMode computes the model's own arithmetic with `backends.invariant.engine`:
every matrix product exactly (fixed-point integers), reductions by a fixed tree, exp / log / sigmoid / silu
/ sin / cos by fixed formulas. The backend ops read the same flag and do the same inside. A row-parallel
linear of the plan (glm5/parallel/plan.py) calls `linear` with its split as an argument: the product
takes its row and column maxima over the group and sums the int64 partial products over it before the one
rounding, so it returns the unsplit layer's bits; the plan then skips its float all-reduce. Only the
forward is invariant: gradients are the ordinary ones.

Serving reads `GLM5_LAYOUT_INVARIANT=1` through `from_env()` (the vLLM plugin's one-line hook).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backends.invariant import engine as num

aten = torch.ops.aten
ENV = "GLM5_LAYOUT_INVARIANT"
#: the backend ops a forward calls; each must declare `layout_invariant` for the mode to run
OPS = ("sparse_mla_attention", "indexer_topk", "topk", "grouped_matmul", "silu_and_mul")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


NotLayoutInvariant = num.NotLayoutInvariant
#: fused losses the mode refuses: their log-sum-exp is the backend's, not SPEC 12's
FUSED_LOSS = (
    "linear_cross_entropy: the fused loss is not layout-invariant (its log-sum-exp is the backend's own "
    "sum); in the layout-invariant mode take log-probs from the logits (log_softmax, as "
    "glm5.train.rl.rollout.sequence_logprobs does)"
)


def active() -> bool:
    return num.active()


def require(backend) -> None:
    """NotLayoutInvariant naming the first op of OPS whose capabilities do not declare the mode."""
    for op in OPS:
        caps = backend.capabilities(op)
        if caps is None or not getattr(caps, "layout_invariant", False):
            raise NotLayoutInvariant(
                f"backend: {backend.name}'s {op} does not declare layout_invariant, so the layout-invariant "
                "mode cannot run on it (the reference, cpu, cuda and ascend backends can)"
            )


RowSplit = num.RowSplit


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: RowSplit) -> torch.Tensor:
    """A row-parallel nn.Linear in the mode (the plan's forward): x [..., K_local] @ weight [N, K_local]^T
    as the exact product with `split` (maxima over the group, integer partials summed over it), then the
    bias as F.linear's addmm adds it. Every rank returns the unsplit layer's bits."""
    out = num.exact_matmul(x.reshape(-1, x.shape[-1]), weight.t(), split=split)
    if bias is not None:
        out = bias + out
    return out.view(*x.shape[:-1], weight.shape[0])


def _sum(x, dims=None, keepdim=False, dtype=None):
    x = x if dtype is None else x.to(dtype)
    if dims is None or len(dims) == 0:
        return num.tree_sum(x.reshape(-1), 0).reshape((1,) * x.dim() if keepdim else ())
    dims = sorted(d % x.dim() for d in dims)
    if len(dims) == 1:
        return num.tree_sum(x, dims[0], keepdim)
    moved = x.movedim(dims, list(range(x.dim() - len(dims), x.dim())))
    out = num.tree_sum(moved.flatten(-len(dims)), -1)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _mean(x, dims=None, keepdim=False, dtype=None):
    s = _sum(x, dims, keepdim, dtype)
    n = x.numel() // max(s.numel(), 1) if dims else x.numel()
    return s / n


def _layer_norm(x, shape, weight, bias, eps):
    dims = list(range(x.dim() - len(shape), x.dim()))
    xf = x.float()
    mean = _mean(xf, dims, True)
    var = _mean((xf - mean) * (xf - mean), dims, True)
    rstd = 1.0 / torch.sqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), mean, rstd


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _FLOATS


_HANDLERS = {
    aten.mm.default: lambda a, b: num.exact_matmul(a, b),
    aten.bmm.default: lambda a, b: num.exact_matmul(a, b),
    aten.addmm.default: lambda bias, a, b, beta=1, alpha=1: beta * bias + alpha * num.exact_matmul(a, b),
    aten.exp.default: num.exp,
    aten.log.default: num.log,
    aten.sigmoid.default: num.sigmoid,
    aten.silu.default: num.silu,
    aten.rsqrt.default: lambda x: 1.0 / torch.sqrt(x),
    aten._softmax.default: lambda x, dim, half: num.softmax(x.float() if half else x, dim),
    aten._log_softmax.default: lambda x, dim, half: num.log_softmax(x.float() if half else x, dim),
    aten.logsumexp.default: lambda x, dims, keepdim=False: _lse(x, dims, keepdim),
    aten.sum.dim_IntList: _sum,
    aten.sum.default: lambda x, dtype=None: _sum(x, None, False, dtype),
    aten.mean.dim: _mean,
    aten.native_layer_norm.default: _layer_norm,
    aten.pow.Tensor_Scalar: lambda x, p: x * x if p == 2 else torch.pow(x, p),
}
_TRIG = {
    aten.sin.default: num.sin,
    aten.cos.default: num.cos,
    aten.pow.Scalar: lambda base, x: num.pow_scalar(base, x) if base > 0 else torch.pow(base, x),
}


def _lse(x, dims, keepdim):
    if len(dims) != 1:
        return torch.logsumexp(x, dims, keepdim)
    return num.logsumexp(x, dims[0], keepdim)


class _InvariantArithmetic(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[-1] if func is aten.pow.Scalar else args[0]
        if func in _TRIG and isinstance(x, torch.Tensor) and x.is_floating_point():
            return _TRIG[func](*args)
        handler = _HANDLERS.get(func)
        if handler is not None and any(_floating(a) for a in args[:3]):
            return handler(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # under inference_mode (vLLM's forward) linear, einsum, ... arrive whole: decompose
                return func.decompose(*args, **kwargs)
        if func.namespace == "glm5" and func.name() == "glm5::linear_cross_entropy":
            raise NotLayoutInvariant(FUSED_LOSS)
        return func(*args, **kwargs)


@contextlib.contextmanager
def layout_invariant(backend=None) -> Iterator[None]:
    """The layout-invariant mode for the code run inside (this thread's model arithmetic, every thread's
    backend ops). With `backend`, first check that it declares the mode for every op of OPS."""
    if backend is not None:
        require(backend)
    with num.switched_on(), _InvariantArithmetic():
        yield


def from_env_requested() -> bool:
    """GLM5_LAYOUT_INVARIANT=1 (0 or unset: False; anything else a ValueError naming the variable)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


def from_env(backend=None) -> contextlib.AbstractContextManager:
    """`layout_invariant(backend)` when GLM5_LAYOUT_INVARIANT=1, else a no-op context."""
    return layout_invariant(backend) if from_env_requested() else contextlib.nullcontext()

"""Linear + cross-entropy in sequence chunks (SPEC 2.9).

    loss = mean_{i : targets[i] != ignore_index} ( logsumexp_v(h[i] @ W[v]) - h[i] @ W[targets[i]] )

fp32 throughout. The forward returns (loss, lse [N]), keeping only the per-row logsumexp; the declared
backward recomputes each chunk's logits from it, so the [N, V] fp32 logits never exist at once (the
chunking is backends/linear_ce.py, shared by every backend; this file gives the per-chunk math). With no
counted target the loss is NaN (as torch.nn.functional.cross_entropy) and the gradients are zero.
`linear_cross_entropy_naive` is the plain definition; tests check the two agree.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from backends import linear_ce
from backends.argcheck import FLOAT_DTYPES, check_int, check_same_device, check_tensor, fail
from backends.caps import OpCaps, OpImpl
from backends.contract.decl import OpDecl
from backends.counters import reference_op
from backends.linear_ce import LinearCEKernels, row_chunks
from backends.reference._common import FLOATS, dim, dtype_of, randn

# Rows per chunk are chosen so one chunk's fp32 logits stay under this many elements.
_CHUNK_ELEMS = 1 << 24


def linear_cross_entropy_naive(h, weight, targets, ignore_index=-100):
    logits = h.float() @ weight.float().T  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets.long(), ignore_index=ignore_index)


def _forward(h, wf, targets, ignore_index):
    counted = targets != ignore_index  # [n]
    tgt = torch.where(counted, targets, 0).long()
    logits = h.float() @ wf.T  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, tgt[:, None])[:, 0]
    return lse, nll[counted].sum()


def _backward(h, wf, targets, ignore_index, lse, scale):
    counted = targets != ignore_index
    tgt = torch.where(counted, targets, 0).long()
    hf = h.float()
    p = torch.exp(hf @ wf.T - lse[:, None])  # softmax [n, V]
    p[torch.arange(p.shape[0]), tgt] -= 1.0
    p = p * (counted[:, None] * scale)
    return p @ wf, p.T @ hf


def _chunks(n: int, v: int):
    return row_chunks(_CHUNK_ELEMS)(n, v)  # read at call time: tests shrink _CHUNK_ELEMS to force chunking


_KERNELS = LinearCEKernels(_chunks, _forward, _backward, cast=lambda h, w: (h, w.float()))


@reference_op("linear_cross_entropy")
def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss fp32 scalar, lse fp32 [N]); the front door returns the loss alone."""
    return linear_ce.forward(_KERNELS, h, weight, targets, ignore_index)


# -- the declaration ---------------------------------------------------------------------------------
def check(h, weight, targets, ignore_index) -> None:
    check_tensor("h", h, dtype=FLOAT_DTYPES, ndim=2)
    n, d = h.shape
    check_tensor("weight", weight, dtype=FLOAT_DTYPES, ndim=2)
    if weight.shape[1] != d:
        fail("weight", f"shape [V, D={d}]", f"shape {list(weight.shape)}")
    check_tensor("targets", targets, dtype=(torch.int64, torch.int32), shape=(n,))
    check_same_device(h=h, weight=weight, targets=targets)
    check_int("ignore_index", ignore_index)


def values(h, weight, targets, ignore_index) -> None:
    n, v = h.shape[0], weight.shape[0]
    if n:
        counted = targets[targets != ignore_index]
        if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= v):
            fail(
                "targets",
                f"values in [0, V={v}) or ignore_index={ignore_index}",
                f"range [{int(counted.min())}, {int(counted.max())}]",
            )


def unchecked(args: dict) -> tuple[dict, Callable]:
    """A target outside [0, V) that is not ignore_index makes the loss NaN (with zero gradients); the
    backend sees it as ignore_index, so no backend reads past the vocabulary."""
    targets, ignore = args["targets"], args["ignore_index"]
    bad = (targets != ignore) & ((targets < 0) | (targets >= args["weight"].shape[0]))
    any_bad = bad.any()

    def finish(loss: torch.Tensor) -> torch.Tensor:
        return torch.where(any_bad, torch.full_like(loss, float("nan")), loss)

    return {**args, "targets": targets.masked_fill(bad, ignore)}, finish


def fake(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    h = a["h"]
    return h.new_empty((), dtype=torch.float32), h.new_empty((h.shape[0],), dtype=torch.float32)


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        h=randn(g, 6, 32, dtype=dt, grad=grad),
        weight=randn(g, 50, 32, dtype=dt, grad=grad),
        targets=torch.tensor([1, 2, -100, 49, 0, 3]),
        ignore_index=-100,
    )


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with the vocabulary ("vocab") at v."""
    dt = dt if dt in FLOATS else "float32"
    h, weight = randn(g, 5, 16, dtype=dt), randn(g, v, 16, dtype=dt)
    return dict(h=h, weight=weight, targets=torch.randint(0, v, (5,), generator=g), ignore_index=-100)


DECL = OpDecl(
    name="linear_cross_entropy",
    spec_section="2.9",
    signature=linear_cross_entropy,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("h"),
    validate=check,
    values=values,
    unchecked=unchecked,
    fake=fake,
    sample=sample,
    sized=sized,
    sharding="unsplit",
    grad_args=("h", "weight"),
    outputs=2,  # the custom op's (loss, lse [N] fp32): lse is what the backward reads (empty [0] without one)
    saves_outputs=True,
    nondiff_outputs=(1,),
    quantities={"vocab": dim("weight", 0)},
    returns=lambda a, out: out[0],
)
IMPL = OpImpl(
    linear_cross_entropy,
    OpCaps(FLOATS, differentiable=True),
    backward=functools.partial(linear_ce.backward, _KERNELS),
)

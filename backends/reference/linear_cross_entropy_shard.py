"""Linear + cross-entropy statistics of one vocabulary shard, in sequence chunks (SPEC 2.9.1).

For the rows [vocab_start, vocab_start + V) of a split output weight, per row i of h:

    max[i]    = max_v logits[i, v]                       logits = h @ weight^T (fp32, [N, V])
    sumexp[i] = sum_v exp(logits[i, v] - max[i])
    target[i] = logits[i, targets[i] - vocab_start]   (0: target ignore_index or not in the shard)

the statistics Megatron's vocab-parallel cross-entropy keeps per rank: the caller combines them over the
group into the global log-sum-exp and the target logit (glm5/parallel/vocab.py). `max` is a shift and
carries no gradient: the gradient through `sumexp` is that of sum exp(logits - max) with max held fixed,
`d logits = d sumexp * exp(logits - max) + d target * onehot(target)`, which is the exact gradient of any
loss that depends on (max, sumexp) only through max + log(sumexp) (a log-sum-exp). The declared backward
recomputes each chunk's logits from the saved max (backends/linear_ce.py's `shard_backward`), so the
[N, V] logits never exist at once. `linear_cross_entropy_shard_naive` is the plain definition.
This module is the op's declaration too (`DECL`: the function below is the signature).
"""

from __future__ import annotations

import functools

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


def linear_cross_entropy_shard_naive(h, weight, targets, vocab_start=0, ignore_index=-100):
    """The definition with torch autograd (max detached): what tests check the chunked op against."""
    logits = h.float() @ weight.float().T
    m = logits.amax(dim=-1).detach()
    s = torch.exp(logits - m[:, None]).sum(dim=-1)
    mine, idx = linear_ce.owned_rows(targets, weight.shape[0], vocab_start, ignore_index)
    t = torch.where(mine, logits.gather(1, idx[:, None])[:, 0], 0.0)
    return m, s, t


def _forward(h, wf, targets, vocab_start, ignore_index):
    logits = h.float() @ wf.T  # [n, V]
    m = logits.amax(dim=-1)
    s = torch.exp(logits - m[:, None]).sum(dim=-1)
    mine, idx = linear_ce.owned_rows(targets, wf.shape[0], vocab_start, ignore_index)
    return m, s, torch.where(mine, logits.gather(1, idx[:, None])[:, 0], 0.0)


def _backward(h, wf, targets, vocab_start, ignore_index, m, gs, gt):
    hf = h.float()
    p = torch.exp(hf @ wf.T - m[:, None]) * gs[:, None]  # [n, V]
    mine, idx = linear_ce.owned_rows(targets, wf.shape[0], vocab_start, ignore_index)
    p[torch.arange(p.shape[0]), idx] += torch.where(mine, gt, 0.0)
    return p @ wf, p.T @ hf


def _chunks(n: int, v: int):
    return row_chunks(_CHUNK_ELEMS)(n, v)  # read at call time: tests shrink _CHUNK_ELEMS to force chunking


_KERNELS = LinearCEKernels(_chunks, _forward, _backward, cast=lambda h, w: (h, w.float()))


@reference_op("linear_cross_entropy_shard")
def linear_cross_entropy_shard(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sumexp, target logit), each fp32 [N]: one vocabulary shard's per-row statistics."""
    return linear_ce.shard_forward(_KERNELS, h, weight, targets, vocab_start, ignore_index)


# -- the declaration ---------------------------------------------------------------------------------
def check(h, weight, targets, vocab_start, ignore_index) -> None:
    check_tensor("h", h, dtype=FLOAT_DTYPES, ndim=2)
    n, d = h.shape
    check_tensor("weight", weight, dtype=FLOAT_DTYPES, ndim=2)
    if weight.shape[1] != d or weight.shape[0] < 1:
        fail("weight", f"shape [V >= 1, D={d}]", f"shape {list(weight.shape)}")
    check_tensor("targets", targets, dtype=(torch.int64, torch.int32), shape=(n,))
    check_same_device(h=h, weight=weight, targets=targets)
    check_int("vocab_start", vocab_start, min_value=0)
    check_int("ignore_index", ignore_index)


def fake(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = a["h"]
    return tuple(h.new_empty((h.shape[0],), dtype=torch.float32) for _ in range(3))


def sample(g: torch.Generator, dt: str, grad: bool) -> dict:
    return dict(
        h=randn(g, 6, 32, dtype=dt, grad=grad),
        weight=randn(g, 25, 32, dtype=dt, grad=grad),
        targets=torch.tensor([1, 30, -100, 49, 25, 3]),  # vocabulary 50, this shard its rows [25, 50)
        vocab_start=25,
        ignore_index=-100,
    )


def sized(g: torch.Generator, dt: str, quantity: str, v: int) -> dict:
    """Arguments with the shard's vocabulary ("vocab") at v (the second of two shards)."""
    dt = dt if dt in FLOATS else "float32"
    h, weight = randn(g, 5, 16, dtype=dt), randn(g, v, 16, dtype=dt)
    targets = torch.randint(0, 2 * v, (5,), generator=g)
    return dict(h=h, weight=weight, targets=targets, vocab_start=v, ignore_index=-100)


DECL = OpDecl(
    name="linear_cross_entropy_shard",
    spec_section="2.9.1",
    signature=linear_cross_entropy_shard,
    dtype_axis=FLOATS,
    dtype_of=dtype_of("h"),
    validate=check,
    fake=fake,
    sample=sample,
    sized=sized,
    sharding="columns or rows local",
    grad_args=("h", "weight"),
    saves_outputs=True,
    nondiff_outputs=(0,),  # the max: a shift, no gradient
    quantities={"vocab": dim("weight", 0)},
)
IMPL = OpImpl(
    linear_cross_entropy_shard,
    OpCaps(FLOATS, differentiable=True),
    backward=functools.partial(linear_ce.shard_backward, _KERNELS),
)

"""cuda backend: linear_cross_entropy -> kernels_cuda.linear_cross_entropy, in sequence chunks.

Forward, per chunk of rows: Triton GEMM -> fp32 logits [n, V], Triton online logsumexp -> lse and
per-row nll; only lse [N] is kept. Backward recomputes each chunk's logits, turns them into
d loss / d logits in place (Triton), then grad_h[chunk] = dlogits @ W and grad_W += dlogits^T @ h
(torch matmul, cuBLAS on a GPU; fp32 operands as the reference, except for bf16 inputs, where
d logits is rounded to bf16 and each chunk's products, accumulated in fp32 by the GEMM, land in fp32
gradient buffers). So at most one chunk of fp32 logits exists at a time (CHUNK_ELEMS elements), never
[N, V]. Loss = sum(nll) / count: NaN when no target is counted (as the reference and torch), and then
zero gradients.
The chunking and the declared backward (from the forward's saved lse) are backends/linear_ce.py's.
"""

from __future__ import annotations

import functools

import torch

from backends import linear_ce
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.linear_ce import LinearCEKernels, row_chunks

#: fp32 logits elements per chunk (256 MiB)
CHUNK_ELEMS = 1 << 26
#: rows per chunk instead of CHUNK_ELEMS (read at each call: tests set it to force chunking)
CHUNK_ROWS: int | None = None


def _cast(h, weight):
    dt = torch.promote_types(h.dtype, weight.dtype)  # tl.dot takes one input dtype: exact widening
    return h.to(dt), weight.to(dt)


def _forward(h, w, targets, ignore_index):
    from kernels_cuda.linear_cross_entropy import chunk_logits, chunk_lse

    lse, nll = chunk_lse(chunk_logits(h, w), targets.contiguous(), ignore_index)
    return lse, nll.sum()


def _backward(h, w, targets, ignore_index, lse, scale):
    from kernels_cuda.linear_cross_entropy import chunk_grad_, chunk_logits

    # bf16 (fp32's exponent range): d logits in bf16 on tensor cores, fp32 accumulation, as Liger-Kernel;
    # fp16 would flush the tiny (p - onehot) / count values, so fp16 and fp32 run the GEMMs in fp32.
    gemm_dtype = torch.bfloat16 if h.dtype == torch.bfloat16 else torch.float32
    # count == 0: every row is ignored, so the kernel's coefficient is 0 whatever the scale is
    d = chunk_grad_(chunk_logits(h, w), targets.contiguous(), lse, scale.reshape(1), ignore_index)
    d = d.to(gemm_dtype)
    return (d @ w.to(gemm_dtype)).float(), (d.T @ h.to(gemm_dtype)).float()


def _kernels() -> LinearCEKernels:
    def chunks(n: int, v: int):
        rows = CHUNK_ROWS
        if rows:
            return [slice(a, min(a + rows, n)) for a in range(0, n, rows)]
        return row_chunks(CHUNK_ELEMS, 128)(n, v)  # whole 128-row GEMM tiles

    return LinearCEKernels(chunks, _forward, _backward, cast=_cast)


_KERNELS = _kernels()


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [N, D] float, weight: [V, D] float, targets: int [N] -> (mean cross-entropy, float32 scalar;
    lse float32 [N], what the declared backward reads).

    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """
    return linear_ce.forward(_KERNELS, h, weight, targets, ignore_index)


IMPL = OpImpl(
    linear_cross_entropy,
    OpCaps(
        FLOATS,
        differentiable=True,
        # the mean's fp32 sum runs over all rows, so one row's contribution is not bitwise batch-independent
        batch_invariant=False,
        notes={"peak logits": f"{CHUNK_ELEMS} fp32 elements per chunk"},
    ),
    backward=functools.partial(linear_ce.backward, _KERNELS),
)

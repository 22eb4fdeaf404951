"""cuda backend: linear_cross_entropy -> kernels_cuda.linear_cross_entropy, in sequence chunks.

Forward, per chunk of rows: Triton GEMM -> fp32 logits [n, V], Triton online logsumexp -> lse and
per-row nll; only lse [N] is kept. Backward recomputes each chunk's logits, turns them into
d loss / d logits in place (Triton), then grad_h[chunk] = dlogits @ W and grad_W += dlogits^T @ h
(torch matmul, cuBLAS on a GPU; fp32 operands as the reference, except for bf16 inputs, where
d logits is rounded to bf16 and each chunk's products, accumulated in fp32 by the GEMM, land in fp32
gradient buffers). So at most one chunk of fp32 logits exists at a time (CHUNK_ELEMS elements), never
[N, V]. Loss = sum(nll) / count: NaN when no target is counted (as the reference and torch), and then
zero gradients.
The autograd.Function lives here because backends/ has no shared wrapper for this op.
"""

from __future__ import annotations

import torch

from backends.caps import OpCaps, OpImpl
from backends.ops import FLOATS

#: fp32 logits elements per chunk (256 MiB)
CHUNK_ELEMS = 1 << 26


def _chunks(n: int, v: int, chunk_rows: int | None):
    step = chunk_rows or max(1, CHUNK_ELEMS // max(1, v))
    if chunk_rows is None and step > 128:
        step -= step % 128            # whole 128-row GEMM tiles
    for a in range(0, n, step):
        yield slice(a, min(a + step, n))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk_rows):
        from kernels_cuda.linear_cross_entropy import chunk_logits, chunk_lse

        # tl.dot takes one input dtype: promote a mixed pair (exact widening)
        dt = torch.promote_types(h.dtype, weight.dtype)
        hc, wc = h.to(dt), weight.to(dt)
        tgt = targets.contiguous()
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        nll = torch.empty(n, dtype=torch.float32, device=h.device)
        for r in _chunks(n, weight.shape[0], chunk_rows):
            lse[r], nll[r] = chunk_lse(chunk_logits(hc[r], wc), tgt[r], ignore_index)
        count = (tgt != ignore_index).sum()
        ctx.save_for_backward(h, weight, tgt, lse, count)
        ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows
        return nll.sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        from kernels_cuda.linear_cross_entropy import chunk_grad_, chunk_logits

        h, weight, tgt, lse, count = ctx.saved_tensors
        dt = torch.promote_types(h.dtype, weight.dtype)
        hc, wc = h.to(dt), weight.to(dt)
        # bf16 (fp32's exponent range): d logits in bf16 on tensor cores, fp32 accumulation, as Liger-Kernel;
        # fp16 would flush the tiny (p - onehot) / count values, so fp16 and fp32 run the GEMMs in fp32.
        gemm_dtype = torch.bfloat16 if dt == torch.bfloat16 else torch.float32
        wg = wc.to(gemm_dtype)
        # count == 0: every row is ignored, so the kernel's coefficient is 0 whatever this scale is
        scale = (grad_loss.float() / count.clamp_min(1)).reshape(1)
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        for r in _chunks(h.shape[0], weight.shape[0], ctx.chunk_rows):
            dlogits = chunk_grad_(chunk_logits(hc[r], wc), tgt[r], lse[r], scale, ctx.ignore_index)
            dlogits = dlogits.to(gemm_dtype)
            grad_h[r] = dlogits @ wg
            grad_w += dlogits.T @ hc[r].to(gemm_dtype)
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_rows: int | None = None) -> torch.Tensor:
    """h: [N, D] float, weight: [V, D] float, targets: int [N] -> mean cross-entropy, float32 scalar,
    differentiable in h and weight. chunk_rows overrides the chunk size (tests use it to force chunking).

    Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
    """
    return _LinearCrossEntropy.apply(h, weight, targets, ignore_index, chunk_rows)


def _linear_cross_entropy(h, weight, targets, ignore_index=-100):
    return linear_cross_entropy(h, weight, targets, ignore_index)


IMPL = OpImpl(_linear_cross_entropy, OpCaps(
    FLOATS, differentiable=True,
    # the mean's fp32 sum runs over all rows, so one row's contribution is not bitwise batch-independent
    batch_invariant=False,
    limits={"peak logits": f"{CHUNK_ELEMS} fp32 elements per chunk"}))

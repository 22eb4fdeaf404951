"""The chunked linear cross-entropy every backend's `linear_cross_entropy` runs (SPEC 2.9), written once.

A backend gives its per-chunk kernels (`LinearCEKernels`) to `forward` (its op function) and `backward`
(its `OpImpl.backward`, run by the `linear_cross_entropy_backward` custom op): the forward returns
(loss, lse [N]) keeping only each row's logsumexp, the backward recomputes each chunk's logits from the
saved lse, so [N, V] never exists and the forward runs once per loss. No counted target: NaN
loss (as torch) and zero gradients, with no host read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LinearCEKernels:
    """A backend's per-chunk work for the chunked linear cross-entropy (SPEC 2.9).

    chunks(n, v) -> row slices, each small enough that one chunk's fp32 logits [rows, V] fit the budget;
    cast(h, weight) -> (h, weight) once per call (e.g. a dtype promotion), before any chunk;
    forward(h_r, weight, targets_r, ignore_index) -> (lse_r fp32 [rows], sum of the counted rows' nll);
    backward(h_r, weight, targets_r, ignore_index, lse_r, scale) -> (d h_r, d weight from these rows), with
      scale = dL/dloss / max(count, 1) and ignored rows contributing nothing.
    """

    chunks: Callable[[int, int], Iterable[slice]]
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    cast: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def forward(
    kernels: LinearCEKernels, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss fp32 scalar, lse fp32 [N]): the op's outputs, lse what the backward reads."""
    hc, wc = kernels.cast(h, weight) if kernels.cast else (h, weight)
    n, v = h.shape[0], weight.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for r in kernels.chunks(n, v):
        lse[r], part = kernels.forward(hc[r], wc, targets[r], ignore_index)
        total = total + part
    return total / (targets != ignore_index).sum(), lse


def backward(
    kernels: LinearCEKernels, args: dict[str, Any], outputs: tuple, grad_outputs: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d h, d weight) from the saved lse and d loss (the lse output carries no gradient)."""
    h, weight, targets, ignore_index = args["h"], args["weight"], args["targets"], args["ignore_index"]
    lse, grad_loss = outputs[1], grad_outputs[0]
    hc, wc = kernels.cast(h, weight) if kernels.cast else (h, weight)
    scale = grad_loss.float() / (targets != ignore_index).sum().clamp_min(1)
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    for r in kernels.chunks(h.shape[0], weight.shape[0]):
        dh, dw = kernels.backward(hc[r], wc, targets[r], ignore_index, lse[r], scale)
        grad_h[r] = dh
        grad_w += dw
    return grad_h.to(h.dtype), grad_w.to(weight.dtype)


def owned_rows(targets: torch.Tensor, width: int, vocab_start: int, ignore_index: int):
    """A vocabulary shard's rows: (rows whose target is one of the shard's `width` rows from `vocab_start`,
    its local index there (0 elsewhere)); every backend's `linear_cross_entropy_shard` uses it."""
    rel = targets.long() - vocab_start
    mine = (targets != ignore_index) & (rel >= 0) & (rel < width)
    return mine, torch.where(mine, rel, 0)


def row_chunks(chunk_elems: int, multiple: int = 1) -> Callable[[int, int], Iterable[slice]]:
    """Row slices whose fp32 logits [rows, V] stay under chunk_elems elements (rows a multiple of
    `multiple` when a chunk holds more than that)."""

    def chunks(n: int, v: int) -> Iterable[slice]:
        step = max(1, chunk_elems // max(1, v))
        if step > multiple:
            step -= step % multiple
        return [slice(a, min(a + step, n)) for a in range(0, n, step)]

    return chunks


def shard_forward(
    kernels: LinearCEKernels,
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_cross_entropy_shard`'s outputs (max, sum of exponentials, target logit; fp32 [N] each) in
    row chunks; here `kernels.forward(h_r, weight, targets_r, vocab_start, ignore_index)` -> the three."""
    hc, wc = kernels.cast(h, weight) if kernels.cast else (h, weight)
    n, v = h.shape[0], weight.shape[0]
    out = tuple(torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))  # no aliasing
    for r in kernels.chunks(n, v):
        for o, x in zip(out, kernels.forward(hc[r], wc, targets[r], vocab_start, ignore_index)):
            o[r] = x
    return out


def shard_backward(
    kernels: LinearCEKernels, args: dict[str, Any], outputs: tuple, grad_outputs: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d h, d weight) of `linear_cross_entropy_shard` from the saved max and the gradients of the sum of
    exponentials and of the target logit (the max carries none); here
    `kernels.backward(h_r, weight, targets_r, vocab_start, ignore_index, max_r, d sumexp_r, d target_r)`."""
    h, weight, targets = args["h"], args["weight"], args["targets"]
    vocab_start, ignore_index = args["vocab_start"], args["ignore_index"]
    m = outputs[0]
    zeros = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    gs, gt = (zeros if g is None else g.float() for g in grad_outputs[1:3])
    hc, wc = kernels.cast(h, weight) if kernels.cast else (h, weight)
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    for r in kernels.chunks(h.shape[0], weight.shape[0]):
        dh, dw = kernels.backward(hc[r], wc, targets[r], vocab_start, ignore_index, m[r], gs[r], gt[r])
        grad_h[r] = dh
        grad_w += dw
    return grad_h.to(h.dtype), grad_w.to(weight.dtype)

"""Expert-parallel dispatch and combine (SPEC 11.1): the reference of the two steps around
`grouped_matmul` when whole experts live on different ranks, built on a group's collectives.

    lay = layout(ids, n_experts)                  # tokens per expert, pairs sorted by expert (so by rank)
    got, d, h = dispatch(x, lay, group)           # only the routed (token, slot) rows travel
    ys = experts.rows(got, d, backend)            # the rank's experts on the rows routed to them
    y = combine(ys, weights, h, group)            # fp32 [T, D]: each token's k slots, in slot order

`group` is any object with the `Group` protocol of glm5/parallel/group.py (rank, size, all_to_all with
variable splits): torch.distributed's gloo / NCCL / HCCL or vLLM's coordinators. Rank r holds experts
[r L, (r + 1) L) with L = n_experts / size. A host with fused kernels for the exchange (DeepEP's
normal and low-latency modes, Ascend's MC2 dispatch / combine) gives its group an `expert_steps` object
with these three functions; the handle `h` is whatever its combine reads back.

Two modes:
- contiguous (capacity None; prefill, training): the split sizes are exchanged and read on the host
  once per dispatch (DeepEP's normal mode does the same), then exactly the routed rows travel and the
  experts see `[rows routed here, D]`, sorted by local expert: 3 exchanges (counts, rows, combine).
- masked (capacity C; decode): every rank sends a fixed `[E, C, D]` buffer (C rows per expert), each
  destination's block led by a header row (or rows) holding the bytes of its per-expert counts, so
  the counts need no exchange of their own (DeepEP's low-latency dispatch, one kernel, also delivers
  both): 2 exchanges (rows, combine), no host read, no data-dependent shape. A rank's pairs past the
  C-th for one expert are dropped: their slot adds nothing to the token's output, and `h.dropped`
  counts them. The rows that arrive are sorted valid-first, so the group offsets end at the valid count and a
  `grouped_matmul` that skips rows past the last offset spends nothing on the padding.

Combine gathers each token's k slot outputs back into slot order and adds them as `moe.combine` does,
so the output is the unsplit layer's bits wherever each expert row is (a `batch_invariant`
grouped_matmul). The exchanges are differentiable: the backward of dispatch is a combine (the reverse
exchange, gradients of a token's copies added at the token) and the backward of combine a dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.moe.dispatch import Dispatch


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return group.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.group.all_to_all(g.contiguous(), ctx.recv, ctx.send), None, None, None


def exchange(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """`group.all_to_all(x, send, recv)`, differentiable: the gradient goes back the way the rows came."""
    if group.size == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exchange.apply(x, group, send, recv)
    return group.all_to_all(x, send, recv)


@dataclass(frozen=True)
class Layout:
    """The layout step: order int64 [T*k] (token, slot) pairs sorted by expert (stable, so by destination
    rank), inverse int64 [T*k] the sorted position of pair t*k + j, starts int64 [E+1] the first sorted
    pair of each expert, per_expert int64 [E] the pairs routed to each expert."""

    order: torch.Tensor
    inverse: torch.Tensor
    starts: torch.Tensor
    per_expert: torch.Tensor
    tokens: int
    top_k: int


@dataclass(frozen=True)
class Handle:
    """What combine needs: the layout, the splits (contiguous) or the send-buffer rows (masked), the
    received rows' expert-sorted permutation and the count of dropped slots (int64 [], 0 if contiguous)."""

    layout: Layout
    send: list[int] | None
    recv: list[int] | None
    slot: torch.Tensor | None  # masked: int64 [T*k] buffer row of each sorted pair, E*C where dropped
    capacity: int | None
    perm: torch.Tensor
    dropped: torch.Tensor


def layout(ids: torch.Tensor, n_experts: int) -> Layout:
    """ids int [T, k] -> the pairs sorted by expert and the tokens per expert (no host read)."""
    t, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, dtype=torch.int64, device=ids.device)
    starts = torch.searchsorted(flat[order], bounds)  # binary search: deterministic, no atomics
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=ids.device)
    return Layout(order, inverse, starts, starts.diff(), t, k)


def _sorted_by_expert(
    recv_counts: torch.Tensor, valid: torch.Tensor | None, rows: int | None = None
) -> tuple[torch.Tensor, ...]:
    """recv_counts [N, L] rows from rank s for local expert l -> (perm, offsets [L+1]): the received rows
    (blocks by source rank, then by local expert) taken expert by expert, valid rows first. rows: the
    received row count the host already holds (contiguous), so the expansion reads nothing back."""
    n, local = recv_counts.shape
    dev = recv_counts.device
    if valid is None:  # contiguous: the received rows are exactly the counted ones
        experts = torch.arange(local, device=dev).repeat(n)
        key = torch.repeat_interleave(experts, recv_counts.reshape(-1), output_size=rows)
    else:  # masked: [N, L, C] slots, the padding sorted past every expert
        key = torch.where(valid, torch.arange(local, device=dev)[None, :, None], local).reshape(-1)
    perm = torch.argsort(key, stable=True)
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    offsets = torch.cat([zero, recv_counts.sum(0).cumsum(0)])
    return perm, offsets


def _header(counts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """counts int64 [N, L] -> [N, H, D] of x's dtype holding the counts' bytes (zero-padded to whole rows):
    a bit copy, so it survives any exchange that moves rows (every all_to_all does; none adds to them)."""
    n, d = counts.shape[0], x.shape[1]
    raw = counts.contiguous().view(torch.uint8).view(n, -1)  # [N, 8 L]
    row = d * x.element_size()
    h = -(-raw.shape[1] // row)
    raw = torch.cat([raw, raw.new_zeros(n, h * row - raw.shape[1])], 1)
    return raw.view(x.dtype).view(n, h, d)


def _read_header(head: torch.Tensor, local: int) -> torch.Tensor:
    """The header rows [N, H, D] an exchange delivered -> the counts int64 [N, L] they carry."""
    n = head.shape[0]
    raw = head.detach().reshape(-1).view(torch.uint8).view(n, -1)  # [N, H D bytes]
    return raw[:, : 8 * local].reshape(-1).view(torch.int64).view(n, local)


def dispatch(
    x: torch.Tensor, lay: Layout, group, capacity: int | None = None
) -> tuple[torch.Tensor, Dispatch, Handle]:
    """x [T, D] -> (rows received [M, D], the local Dispatch (token: the expert-sorted order of those rows,
    offsets [L+1]) for `rows` / grouped_matmul, the handle for combine)."""
    n, k = group.size, lay.top_k
    e = lay.per_expert.shape[0]
    local = e // n
    split = [local] * n
    dev = x.device
    if capacity is None:
        # recv_counts[s, l]: rows rank s sends to local expert l
        recv_counts = group.all_to_all(lay.per_expert, split, split).view(n, local)
        sizes = torch.cat([lay.per_expert.view(n, local).sum(1), recv_counts.sum(1)]).tolist()  # host read
        send, recv = sizes[:n], sizes[n:]
        got = exchange(x[lay.order // k], group, send, recv)  # [M, D] by source rank, then expert
        perm, offsets = _sorted_by_expert(recv_counts, None, sum(recv))
        dropped = torch.zeros((), dtype=torch.int64, device=dev)
        h = Handle(lay, send, recv, None, None, perm, dropped)
    else:
        expert = torch.repeat_interleave(
            torch.arange(e, device=dev), lay.per_expert, output_size=lay.order.numel()
        )
        pos = torch.arange(lay.order.numel(), device=dev) - lay.starts[expert]  # place within its expert
        keep = pos < capacity
        slot = torch.where(keep, expert * capacity + pos, e * capacity)  # [T*k]; e*C: the drop row
        # the send buffer [E*C, D] gathered from the pairs (index e*C+... of no pair: a zero row)
        src = torch.full((e * capacity + 1,), lay.order.numel(), dtype=torch.int64, device=dev)
        src[slot] = torch.arange(lay.order.numel(), device=dev)
        rows = torch.cat([x[lay.order // k], x.new_zeros(1, x.shape[1])])
        buf = rows[src[: e * capacity]].view(n, local * capacity, x.shape[1])
        # the counts travel in the same exchange: a header of H rows per destination holding their bytes
        head = _header(lay.per_expert.clamp(max=capacity).view(n, local), x)  # [N, H, D]
        h_rows = head.shape[1]
        cap_split = [h_rows + local * capacity] * n
        got = exchange(torch.cat([head, buf], 1).view(-1, x.shape[1]), group, cap_split, cap_split)
        got = got.view(n, h_rows + local * capacity, x.shape[1])
        recv_counts = _read_header(got[:, :h_rows], local)  # [N, L] from each source rank
        got = got[:, h_rows:].reshape(n * local * capacity, x.shape[1])  # [N*L*C, D]
        valid = torch.arange(capacity, device=dev)[None, None, :] < recv_counts[..., None]
        perm, offsets = _sorted_by_expert(recv_counts, valid)
        h = Handle(lay, None, None, slot, capacity, perm, (~keep).sum())
    return got, Dispatch(None, perm, offsets, None, 1), h


def combine(ys: torch.Tensor, weights: torch.Tensor, h: Handle, group) -> torch.Tensor:
    """ys [M, D] the experts' outputs in the local expert-sorted order, weights fp32 [T, k] -> fp32 [T, D]:
    sum_j weights[t, j] * (output of pair (t, j)), over j in slot order (`moe.combine`'s arithmetic)."""
    lay = h.layout
    back_local = torch.empty_like(ys)
    back_local = back_local.index_copy(0, h.perm, ys)  # back in the order the rows arrived
    if h.capacity is None:
        per_sorted = exchange(back_local, group, h.recv, h.send)  # [T*k, D] in sorted pair order
    else:
        n = group.size
        cap_split = [ys.shape[0] // n] * n
        back = exchange(back_local, group, cap_split, cap_split)  # [E*C, D]
        per_sorted = torch.cat([back, back.new_zeros(1, back.shape[1])])[h.slot]  # dropped: zero
    per_slot = per_sorted.float()[lay.inverse].view(
        lay.tokens, lay.top_k, ys.shape[-1]
    )  # [T, k, D]; T may be 0
    return (per_slot * weights.float()[..., None]).sum(dim=1)

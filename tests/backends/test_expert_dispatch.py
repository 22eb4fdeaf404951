"""Expert dispatch and combine (backends/moe/expert_parallel.py, SPEC 11.1) on 2 gloo ranks, each with its own
tokens, against the unsplit layer (backends/moe/dispatch.py + the reference grouped_matmul) on the same
tokens: bitwise in both modes, drops counted on overflow, gradients of the tokens, the routing weights and the
experts."""

from __future__ import annotations

import pytest
import torch

from backends.moe import dispatch as moe
from backends.moe import expert_parallel as expert_dispatch
from backends.reference.grouped_matmul import grouped_matmul
from tests.ranks import run_ranks

E, K, D, N = 8, 2, 16, 12  # experts, top-k, width, output width


def _inputs(rank: int, t: int, skew: bool = False):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(t, D, generator=g)
    ids = torch.randint(0, E, (t, K), generator=g)
    if skew:  # every token's first slot to expert 0, on every rank: overflow for a small capacity
        ids[:, 0] = 0
        ids[:, 1] = torch.randint(1, E, (t,), generator=g)
    w = torch.rand(t, K, generator=g)
    return x, ids.to(torch.int32), w


def _weights() -> torch.Tensor:
    return torch.randn(E, N, D, generator=torch.Generator().manual_seed(0))


def _unsplit(x, ids, w, weight):
    d = moe.dispatch(ids, E)
    return moe.combine(grouped_matmul(x[d.token], weight, d.offsets), w, d)


ROOM = 9 + 4  # the most pairs one rank can route to one expert (each of its tokens once)
MODES = {"contiguous": (None, False), "masked": (ROOM, False), "overflow": (3, True)}


def _all_modes(rank: int, world: int) -> dict:
    from glm5.parallel.group import TorchGroup

    group = TorchGroup()
    return {name: _mode(group, rank, world, *args) for name, args in MODES.items()}


@pytest.fixture(scope="module")
def ranks() -> dict:
    """One launch of 2 ranks for every mode: {mode: [rank 0's result, rank 1's]}."""
    results = run_ranks(_all_modes, 2)
    return {name: [r[name] for r in results] for name in MODES}


class _Exchanges:
    """The group, its all_to_all calls recorded."""

    def __init__(self, group, calls: list) -> None:
        self.group, self.calls, self.rank, self.size = group, calls, group.rank, group.size

    def all_to_all(self, x, send, recv):
        self.calls.append(len(send))
        return self.group.all_to_all(x, send, recv)


def _mode(group, rank: int, world: int, capacity, skew: bool) -> dict:
    t = 5 + 4 * rank  # unequal token counts per rank
    x, ids, w = _inputs(rank, t, skew)
    weight = _weights()
    local = weight[rank * E // world : (rank + 1) * E // world].clone().requires_grad_()
    x.requires_grad_()
    w.requires_grad_()
    lay = expert_dispatch.layout(ids, E)
    exchanges = []
    counting = _Exchanges(group, exchanges)
    got, d, h = expert_dispatch.dispatch(x, lay, counting, capacity)
    ys = grouped_matmul(got[d.token], local, d.offsets)
    y = expert_dispatch.combine(ys, w, h, counting)
    forward = len(exchanges)
    (y * torch.linspace(-1, 1, N)).sum().backward()
    return {
        "exchanges": forward,
        "y": y.detach(),
        "dropped": int(h.dropped),
        "rows": int(d.offsets[-1]),
        "buffer": got.shape[0],
        "gx": x.grad,
        "gw": w.grad,
        "glocal": local.grad,
    }


def test_a_rank_with_no_tokens_combines_to_an_empty_output():
    """A rank can hold no tokens (expert parallel's 1/N chunk of a one-token decode step): it still joins the
    exchanges and gets back [0, N]."""
    from glm5.parallel.group import Single

    x, ids, w = _inputs(0, 0)
    for capacity in (None, ROOM):
        lay = expert_dispatch.layout(ids, E)
        got, d, h = expert_dispatch.dispatch(x, lay, Single(), capacity)
        y = expert_dispatch.combine(grouped_matmul(got[d.token], _weights(), d.offsets), w, h, Single())
        assert y.shape == (0, N), capacity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 3])
def test_masked_counts_travel_in_header_rows_of_any_width(dtype, width):
    """The masked dispatch sends its counts' bytes as header rows of x's dtype: narrow rows need several,
    and the bytes must come back as the counts (the offsets) whatever floats they read as."""
    from glm5.parallel.group import Single

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, width, generator=g).to(dtype)
    ids = torch.randint(0, E, (7, K), generator=g).to(torch.int32)
    lay = expert_dispatch.layout(ids, E)
    got, d, h = expert_dispatch.dispatch(x, lay, Single(), ROOM)
    assert got.shape == (E * ROOM, width)
    assert torch.equal(d.offsets, torch.cat([torch.zeros(1, dtype=torch.int64), lay.per_expert.cumsum(0)]))
    assert torch.equal(got[d.token[: d.offsets[-1]]], x[lay.order // K])  # every routed row, by expert


def _check(results):
    weight = _weights().requires_grad_()
    per_rank = []
    for rank, r in enumerate(results):
        x, ids, w = _inputs(rank, 5 + 4 * rank)
        x.requires_grad_()
        w.requires_grad_()
        y = _unsplit(x, ids, w, weight)
        (y * torch.linspace(-1, 1, N)).sum().backward()
        per_rank.append((x, ids, w, y.detach()))
        assert torch.equal(r["y"], y.detach())  # the reference's rows are batch invariant: the same bits
        torch.testing.assert_close(r["gx"], x.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["gw"], w.grad, rtol=1e-6, atol=1e-6)
    half = E // len(results)
    for rank, r in enumerate(results):  # each rank's experts got the gradient of every rank's tokens
        torch.testing.assert_close(
            r["glocal"], weight.grad[rank * half : (rank + 1) * half], rtol=1e-5, atol=1e-5
        )
    return per_rank


def test_contiguous_dispatch_is_the_unsplit_layer(ranks):
    results = ranks["contiguous"]
    per_rank = _check(results)
    total = sum(ids.numel() for _, ids, _, _ in per_rank)
    # only routed copies travel: the ranks' experts together see every (token, slot) pair once
    assert sum(r["rows"] for r in results) == sum(r["buffer"] for r in results) == total
    assert all(r["dropped"] == 0 for r in results)
    assert all(r["exchanges"] == 3 for r in results)  # counts (read on the host), rows, combine


def test_masked_dispatch_with_room_is_the_unsplit_layer(ranks):
    capacity = ROOM
    results = ranks["masked"]
    _check(results)
    for r in results:
        assert r["buffer"] == 2 * (E // 2) * capacity  # fixed: ranks x local experts x capacity
        assert r["rows"] <= r["buffer"] and r["dropped"] == 0
        assert r["exchanges"] == 2  # the counts travel in the rows' exchange (a header): rows, combine


def test_masked_dispatch_drops_past_capacity_and_counts_them(ranks):
    capacity = MODES["overflow"][0]
    results = ranks["overflow"]
    weight = _weights()
    for rank, r in enumerate(results):
        x, ids, w = _inputs(rank, 5 + 4 * rank, True)
        # every token sends slot 0 to expert 0: all but the first `capacity` (in token order) drop
        t = x.shape[0]
        expected_drops = (t - capacity) + sum(
            max(int((ids[:, 1] == e).sum()) - capacity, 0) for e in range(1, E)
        )
        assert r["dropped"] == expected_drops
        # a dropped slot adds nothing: the unsplit layer with those slots' weights zero
        d = moe.dispatch(ids, E)
        sorted_expert = ids.reshape(-1)[d.order].long()
        pos = torch.arange(d.order.numel()) - d.offsets[sorted_expert]
        kept = torch.empty(d.order.numel(), dtype=torch.bool)
        kept[d.order] = pos < capacity
        wk = torch.where(kept.view(t, K), w, 0.0)
        assert int((~kept).sum()) == expected_drops
        assert torch.equal(r["y"], _unsplit(x, ids, wk, weight).detach())

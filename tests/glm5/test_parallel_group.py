"""The `Group` collectives on 3 gloo ranks (3, so that the order of a sum shows), on both hosts (TorchGroup,
and VllmGroup over a stand-in for vLLM's GroupCoordinator): the host's own sums by default, the fixed
rank-order sum on request, variable-split all-to-all."""

from __future__ import annotations

import torch

from backends.invariant import engine as invariant
from glm5.parallel.group import Single, TorchGroup, exact_sums, sum_in_rank_order
from tests.ranks import run_ranks

WORLD = 3


def _x(rank: int, shape=(7, 5)) -> torch.Tensor:
    # magnitudes 1e-3 .. 1e4 so that (a + b) + c and a + (b + c) differ in fp32
    g = torch.Generator().manual_seed(rank)
    return torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 5, shape, generator=g)


class _Coordinator:
    """vLLM's GroupCoordinator as glm5/vllm/parallel.py uses it (rank_in_group, world_size, device_group,
    all_gather, an in-place all_reduce, reduce_scatter), on torch.distributed: vLLM is not needed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.device_group = dist, None
        self.rank_in_group, self.world_size = dist.get_rank(), dist.get_world_size()
        self.calls: list[str] = []

    def all_gather(self, x, dim):
        self.calls.append("all_gather")
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def all_reduce(self, x):
        self.calls.append("all_reduce")
        self.dist.all_reduce(x)
        return x

    def reduce_scatter(self, x, dim):
        self.calls.append("reduce_scatter")
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        self.dist.reduce_scatter_single(out, x)
        return out


def _rank(rank: int, world: int) -> dict:
    from glm5.vllm.parallel import VllmGroup

    out = {"torch": _collectives(TorchGroup(), rank)}
    coordinator = _Coordinator()
    out["vllm"] = _collectives(VllmGroup(coordinator), rank)
    out["vllm_int"] = VllmGroup(coordinator).all_reduce(torch.arange(4) * (rank + 1))  # not its dtypes
    out["vllm_calls"] = sorted(set(coordinator.calls))
    return out


def _collectives(g, rank: int) -> dict:
    x = _x(rank)
    rows = torch.arange(6 * 4, dtype=torch.float32).view(6, 4) + 100 * rank
    send = [[1, 0, 5], [0, 0, 6], [2, 2, 2]][rank]  # rank r sends send[s] rows to rank s
    recv = [[1, 0, 2], [0, 0, 2], [5, 6, 2]][rank]
    return {
        "native": g.all_reduce(x),
        "exact": g.all_reduce(x, exact=True),
        "exact_int": g.all_reduce(torch.arange(5, dtype=torch.int64) * (rank + 1), exact=True),
        "rs": g.reduce_scatter(_x(rank, (6, 5))),
        "rs_exact": g.reduce_scatter(_x(rank, (6, 5)), exact=True),
        "a2a": g.all_to_all(rows[: sum(send)], send, recv),
        "input_kept": torch.equal(x, _x(rank)),
    }


def test_sums_all_to_all_and_the_fixed_order_on_both_hosts():
    launched = run_ranks(_rank, WORLD)
    # vLLM's host: the coordinator's own all_reduce / reduce_scatter / all_gather carry the float sums
    assert launched[0]["vllm_calls"] == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(torch.equal(r["vllm_int"], torch.arange(4) * 6) for r in launched)
    for host in ("torch", "vllm"):
        _check([r[host] for r in launched])


def _check(results: list) -> None:
    xs = [_x(r) for r in range(WORLD)]
    in_order = sum_in_rank_order(xs)
    assert not torch.equal(in_order, xs[0] + (xs[1] + xs[2]))  # the inputs make the order visible
    for rank, r in enumerate(results):
        assert r["input_kept"]
        # exact: the rank-order sum's bits on every rank (the padded, chunked path adds each element as
        # sum_in_rank_order does); native: the host's sum, equal up to rounding
        assert torch.equal(r["exact"], in_order)
        torch.testing.assert_close(r["native"], in_order, rtol=1e-5, atol=1e-2)
        assert torch.equal(r["exact_int"], torch.arange(5) * 6)
        full = sum_in_rank_order([_x(s, (6, 5)) for s in range(WORLD)])
        assert torch.equal(r["rs_exact"], full[2 * rank : 2 * rank + 2])
        torch.testing.assert_close(r["rs"], full[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-2)
    # every rank's native sum is the same bits (gloo reduces each chunk once), not promised in general
    assert all(torch.equal(r["native"], results[0]["native"]) for r in results)
    rows = [torch.arange(24, dtype=torch.float32).view(6, 4) + 100 * s for s in range(WORLD)]
    sends = [[1, 0, 5], [0, 0, 6], [2, 2, 2]]
    for rank, r in enumerate(results):
        expected = []
        for s in range(WORLD):
            start = sum(sends[s][:rank])
            expected.append(rows[s][start : start + sends[s][rank]])
        assert torch.equal(r["a2a"], torch.cat(expected))


def test_single_is_the_identity_and_the_policy_follows_validate_and_the_invariant_mode(monkeypatch):
    x = torch.randn(3, 2)
    s = Single()
    assert s.all_reduce(x, exact=True) is x and s.reduce_scatter(x) is x and s.all_to_all(x, [3], [3]) is x
    monkeypatch.delenv("GLM5_VALIDATE", raising=False)
    assert not exact_sums()
    with invariant.switched_on():
        assert exact_sums()
    assert not exact_sums()
    monkeypatch.setenv("GLM5_VALIDATE", "topk")
    assert exact_sums()

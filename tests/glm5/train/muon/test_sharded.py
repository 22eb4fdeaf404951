"""DistributedMuon: each rank's shard after a step equals the slice of the 1-process Muon's result bitwise;
bytes per rank equal the analytic figure; whole heads / experts move nothing; one Newton-Schulz per matrix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import glm5.train.muon.optimizer as muon_mod
from glm5.core.config import GLM5Config
from glm5.parallel.layout import ParamLayout, ShardInfo
from glm5.train.muon.layout import SCHEMES, Layout, assign_owners, chunk_ranges
from glm5.train.muon.optimizer import Blocks, Muon, build_optimizers
from glm5.train.muon.sharded import DistributedMuon, build_distributed_optimizers
from glm5.train.muon.traffic import muon_bytes, muon_params
from tests.glm5._util import make_model
from tests.ranks import run_ranks

LR, WD = 0.02, 0.1


# -- pure units ----------------------------------------------------------------------------------------
def test_owner_assignment_is_balanced_greedy_largest_first():
    costs = [9.0, 7.0, 6.0, 5.0, 5.0, 4.0, 3.0, 1.0, 1.0]
    owners = assign_owners(costs, 3)
    load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(3)]
    assert owners == [0, 1, 2, 2, 1, 0, 2, 1, 0]  # largest first, each to the least-loaded rank
    assert max(load) - min(load) <= max(costs)  # the greedy bound; here 14/13/14
    assert sorted(load) == [13.0, 14.0, 14.0]
    assert assign_owners(costs, 3) == owners  # the same on every rank
    assert set(assign_owners([1.0] * 8, 4)) == {0, 1, 2, 3}


def test_whole_blocks_per_shard_follow_torch_chunk():
    assert chunk_ranges(5, 4) == ((0, 2), (2, 2), (4, 1), (5, 0))
    assert [n for _, n in chunk_ranges(10, 4)] == [len(c) for c in torch.arange(10).chunk(4)]
    # 4 heads of 24 rows at 2 ranks: whole heads; at 3 ranks the 32-row chunks split a head
    assert Layout((96, 48), 0, chunk_ranges(96, 2), 1).local_blocks(Blocks(4, (24,))) == Blocks(2, (24,))
    assert Layout((96, 48), 0, chunk_ranges(96, 3), 1).local_blocks(Blocks(4, (24,))) is None
    # 2 heads of 2 rows at 3 ranks: chunks of 1, 1, 0 heads (uneven, still whole)
    assert Layout((4, 8), 0, chunk_ranges(4, 3), 1).local_blocks(Blocks(2, (2,))) == Blocks(1, (2,))
    assert Layout((4, 8), 0, chunk_ranges(4, 3), 2).local_blocks(Blocks(2, (2,))) == Blocks(0, (2,))
    # 3 heads at 2 ranks split a head: the owner path
    assert Layout((24, 16), 0, chunk_ranges(24, 2), 0).local_blocks(Blocks(3, (8,))) is None
    # stacked experts: dim 0 counts experts, each r rows; 3 experts at 2 ranks -> 2 and 1, whole
    assert Layout((3, 8, 6), 0, chunk_ranges(3, 2), 1).local_blocks(Blocks(3, (8,))) == Blocks(1, (8,))
    assert Layout((64, 64), 1, ((0, 32), (32, 32)), 0).local_blocks(Blocks(1, (64,))) is None


def test_analytic_bytes_reproduce_the_issue_figures():
    params = muon_params(GLM5Config.from_preset("tiny"))
    mb = {s: muon_bytes(None, 4, s, params=params)["total"] / 1e6 for s in ("naive", "owner", "split")}
    assert (round(mb["naive"], 2), round(mb["owner"], 2), round(mb["split"], 2)) == (1.10, 0.55, 0.19)
    split = muon_bytes(None, 4, "split", params=params)
    assert split["per-head"] == split["per-expert"] == 0
    # GLM-5 at 8 ranks: whole heads and experts stay put, the rest is 1.8% of the bytes, 0.46% of naive
    big = muon_params(GLM5Config.from_preset("glm5-744b"))
    fig = {s: muon_bytes(None, 8, s, element_size=2, params=big)["total"] for s in SCHEMES}
    assert round(100 * fig["split"] / fig["naive"], 2) == 0.46
    assert round(100 * fig["split"] / fig["owner"], 1) == 1.8


def test_bad_scheme_is_one_clear_error():
    with pytest.raises(ValueError, match="scheme: expected one of"):
        muon_bytes(None, 2, "ring", params=[])
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="scheme: expected 'owner' or 'split'"):
        DistributedMuon([{"params": [p], "blocks": [Blocks(1, (4,))]}], scheme="naive")
    with pytest.raises(ValueError, match=r"blocks: .* does not tile a parameter of shape \(4, 4\)"):
        DistributedMuon([{"params": [p], "blocks": [Blocks(3, (4,))]}])


# -- 2 ranks -------------------------------------------------------------------------------------------
class Odd(nn.Module):
    """Shapes the tiny model lacks: 3 heads at 2 ranks (a head split: owner path), 5 rows (uneven
    shards, padded), 3 stacked experts (2 + 1, whole: local), one row (rank 1 holds nothing: local)."""

    SHAPES = {
        "heads3": ((24, 16), Blocks(3, (8,))),
        "rows5": ((5, 12), Blocks(1, (5,))),
        "experts3": ((3, 8, 6), Blocks(3, (8,))),
        "row1": ((1, 7), Blocks(1, (1,))),
    }

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        for name, (shape, _) in self.SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen)))


TP = {  # name: (full shape, Blocks, kind, dim)
    "heads": ((96, 48), Blocks(4, (24,)), "heads", 0),
    "colwise": ((128, 64), Blocks(1, (128,)), "colwise", 0),
    "rowwise": ((64, 128), Blocks(1, (64,)), "rowwise", 1),
    "experts_tp": ((8, 32, 64), Blocks(8, (32,)), "experts-tp", 1),
    "experts_ep": ((8, 64, 32), Blocks(8, (64,)), "experts-ep", 0),
}


def _grad(shape, step: int, k: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + k))


def _count_ns(counter: list[int]):
    real = muon_mod.zeropower_via_newtonschulz

    def counted(g, *a, **kw):
        counter.append(g[..., 0, 0].numel())  # matrices in this call
        return real(g, *a, **kw)

    return counted


def _set_grads(step: int, ref_params, params, mesh, rank: int, world: int, shards: dict) -> None:
    """The same random full gradient on the reference parameter and, sliced, on the shard."""
    from torch.distributed.tensor import DTensor, Shard

    for k, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
        g = _grad(rp.shape, step, k)
        rp.grad = g
        if isinstance(p, DTensor):
            s, n = chunk_ranges(g.shape[0], world)[rank]
            local = g.narrow(0, s, n).contiguous()
            p.grad = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            info = shards[p]
            p.grad = g.narrow(info.dim, info.rank * p.shape[info.dim], p.shape[info.dim]).clone()


def _mismatches(ref_params, params, rank: int, world: int, shards: dict) -> list[str]:
    """Shards that differ from the slice of the reference parameter (bitwise)."""
    bad = []
    for k, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
        if hasattr(p, "to_local"):
            s, n = chunk_ranges(rp.shape[0], world)[rank]
            want, got = rp.detach().narrow(0, s, n), p.to_local()
        else:
            info = shards[p]
            want = rp.detach().narrow(info.dim, info.rank * p.shape[info.dim], p.shape[info.dim])
            got = p.detach()
        if not torch.equal(want, got):
            bad.append(f"param {k} {tuple(rp.shape)}: max diff {(want - got).abs().max().item()}")
    return bad


def _ranks_fsdp_tp(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    wire = {"sent": 0, "received": 0}
    real_gather, real_scatter = dist.gather, dist.scatter

    def gather(t, gather_list=None, group=None, group_dst=0, **kw):
        n = t.numel() * t.element_size()
        wire["received" if rank == group_dst else "sent"] += n * (world - 1 if rank == group_dst else 1)
        return real_gather(t, gather_list, group=group, group_dst=group_dst, **kw)

    def scatter(t, scatter_list=None, group=None, group_src=0, **kw):
        n = t.numel() * t.element_size()
        wire["sent" if rank == group_src else "received"] += n * (world - 1 if rank == group_src else 1)
        return real_scatter(t, scatter_list, group=group, group_src=group_src, **kw)

    dist.gather, dist.scatter = gather, scatter
    ns: list[int] = []
    muon_mod.zeropower_via_newtonschulz = _count_ns(ns)

    # the references: 1-process Muon on the full parameters (every rank computes them)
    ref_model = make_model(0)
    ref_opt = build_optimizers(ref_model, "muon-split", LR, WD)[0]
    odd_ref = Odd()
    tp_ref = {n: nn.Parameter(_grad(s, 99, i)) for i, (n, (s, *_)) in enumerate(TP.items())}
    extra_ref = Muon(
        [
            {
                "params": [*odd_ref.parameters(), *tp_ref.values()],
                "blocks": [b for _, b in Odd.SHAPES.values()] + [b for _, b, *_ in TP.values()],
            }
        ],
        lr=LR,
        weight_decay=WD,
    )
    ref_matrices = []

    # the sharded copies: FSDP2 on the tiny model and on Odd, tensor / expert parallel slices for TP
    def shard_model():
        model = copy.deepcopy(make_model(0))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, build_distributed_optimizers(model, "muon-split", LR, WD)[0]

    model, opt = shard_model()
    odd = fully_shard(Odd(), mesh=mesh)
    tp, shards = {}, {}
    for i, (n, (shape, _, kind, dim)) in enumerate(TP.items()):
        size = shape[dim] // world
        p = nn.Parameter(_grad(shape, 99, i).narrow(dim, rank * size, size).clone())
        tp[n] = p
        shards[p] = ShardInfo(kind, dim, rank, world, shape)  # group None: the default process group
    extra = DistributedMuon(
        [
            {
                "params": [*odd.parameters(), *tp.values()],
                "blocks": [b for _, b in Odd.SHAPES.values()] + [b for _, b, *_ in TP.values()],
            }
        ],
        lr=LR,
        weight_decay=WD,
        placements={p: ParamLayout(info) for p, info in shards.items()},
    )
    out: dict = {"steps": []}

    ref_lists = (ref_opt.param_groups[0]["params"], extra_ref.param_groups[0]["params"])
    for step in (1, 2):
        if step == 2:  # resume the sharded Muon from a torch.distributed.checkpoint of step 1
            dcp.save(
                {"muon": get_optimizer_state_dict(model, opt), "model": model.state_dict()},
                checkpoint_id=f"{tmp}/dcp",
            )
            before = {k: _local(v).clone() for k, v in model.state_dict().items()}
            model, opt = shard_model()
            state = {"muon": get_optimizer_state_dict(model, opt), "model": model.state_dict()}
            dcp.load(state, checkpoint_id=f"{tmp}/dcp")
            model.load_state_dict(state["model"])
            set_optimizer_state_dict(model, opt, state["muon"])
            assert all(torch.equal(before[k], _local(v)) for k, v in model.state_dict().items())
        lists = (opt.param_groups[0]["params"], extra.param_groups[0]["params"])
        for rl, pl in zip(ref_lists, lists, strict=True):
            _set_grads(step, rl, pl, mesh, rank, world, shards)
        ns.clear()
        ref_opt.step()
        extra_ref.step()
        ref_matrices.append(sum(ns))
        ns.clear()
        wire.update(sent=0, received=0)
        opt.step()
        fsdp_wire = dict(wire)
        extra.step()
        out["steps"].append(
            {
                "bad": _mismatches(ref_lists[0], lists[0], rank, world, shards)
                + _mismatches(ref_lists[1], lists[1], rank, world, shards),
                "ns_matrices": sum(ns),
                "ns_calls": len(ns),
                "bytes": opt.last_step_bytes,
                "planned": opt.planned_bytes(),
                "wire": fsdp_wire,
                "extra_bytes": extra.last_step_bytes,
            }
        )
    out["ref_matrices"] = ref_matrices
    out["owners"] = {k: e.owner for k, e in enumerate(opt._entries.values())}
    out["plan"] = _plan_steps(rank, world)
    return out


def _plan_steps(rank: int, world: int) -> dict:
    """The tiny model split by glm5.parallel.plan (tp=2, experts ep=2): two steps against 1-process Muon."""
    from glm5.parallel.group import TorchGroup
    from glm5.parallel.plan import apply

    ref = make_model(0)
    ref_opt = build_optimizers(ref, "muon-split", LR, WD)[0]
    model = make_model(0)
    plan = apply(model, tp=TorchGroup(), ep=TorchGroup())  # its copies: tp, which holds whole copies
    opt = build_distributed_optimizers(model, "muon-split", LR, WD)[0]
    names = {id(p): n for n, p in model.named_parameters()}
    ref_by_name = dict(ref.named_parameters())
    params = opt.param_groups[0]["params"]
    ref_params = [ref_by_name[names[id(p)]] for p in params]
    kinds = set()
    bad = []
    for step in (1, 2):
        for k, (rp, p) in enumerate(zip(ref_params, params, strict=True)):
            g = _grad(rp.shape, step, k)
            rp.grad = g
            info = plan.get(names[id(p)])  # None: whole, one owner orthogonalises, broadcast to the copies
            p.grad = g if info is None else g.narrow(info.dim, info.start, info.length).clone()
        ref_opt.step()
        opt.step()
        for rp, p in zip(ref_params, params, strict=True):
            info = plan.get(names[id(p)])
            want = rp.detach() if info is None else rp.detach().narrow(info.dim, info.start, info.length)
            if not torch.equal(want, p.detach()):
                bad.append(f"step {step} {names[id(p)]}")
            kinds.add(info.kind if info else "replicated")
    ref_matrices = 2 * sum(b.heads * len(b.sections) for b in ref_opt.param_groups[0]["blocks"])
    return {
        "bad": bad,
        "kinds": sorted(kinds),
        "bytes": opt.last_step_bytes,
        "planned": opt.planned_bytes(),
        "ns_matrices": opt.ns_matrices,
        "ref_matrices": ref_matrices,
    }


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p.data


def test_two_ranks_fsdp2_and_tensor_parallel_bitwise_bytes_and_one_newton_schulz(tmp_path):
    results = run_ranks(_ranks_fsdp_tp, 2, str(tmp_path))
    analytic = muon_bytes(GLM5Config.from_preset("tiny"), 2, "split")
    for step in range(2):
        per_rank = [r["steps"][step] for r in results]
        for r, s in enumerate(per_rank):
            assert not s["bad"], f"rank {r} step {step + 1}: {s['bad']}"
            assert s["bytes"] == s["planned"]  # what the step counted = what the layouts say
            assert s["wire"] == {"sent": s["bytes"].total_sent, "received": s["bytes"].total_received}
            assert s["bytes"].sent["per-head"] == s["bytes"].sent["per-expert"] == 0
            assert s["bytes"].received["per-head"] == s["bytes"].received["per-expert"] == 0
        # the mean over the ranks is the analytic figure (sent = received in total)
        assert sum(s["bytes"].total_received for s in per_rank) / 2 == analytic["total"]
        assert sum(s["bytes"].total_sent for s in per_rank) / 2 == analytic["total"]
        # every matrix (head, expert) orthogonalised exactly once across the ranks
        assert sum(s["ns_matrices"] for s in per_rank) == results[0]["ref_matrices"][step]
        # fallbacks that move bytes: 3 heads at 2 ranks (per-head), rows5 / TP col- and rowwise (matrix),
        # experts split on their intermediate dim (per-expert); whole TP heads / EP experts move nothing
        extra = [s["extra_bytes"] for s in per_rank]
        assert all(e.received["per-head"] > 0 and e.received["per-expert"] > 0 for e in extra)
    assert set(results[0]["owners"].values()) >= {-1, 0, 1}  # local ones, and owners on both ranks
    # the lead's plan: whole heads and whole experts move nothing, col- / rowwise go through an owner
    for r, res in enumerate(results):
        plan = res["plan"]
        assert not plan["bad"], f"rank {r}: {plan['bad']}"
        assert plan["kinds"] == ["colwise", "experts-ep", "heads", "replicated", "rowwise"]
        assert plan["bytes"] == plan["planned"]
        assert plan["bytes"].received["per-head"] == plan["bytes"].received["per-expert"] == 0
        assert plan["bytes"].received["matrix"] > 0
    # whole copies (q_a_proj, the indexer, the router, ...) are orthogonalised by one owner and broadcast:
    # over both ranks and two steps, each matrix of the 1-process Muon exactly once per step
    assert sum(res["plan"]["ns_matrices"] for res in results) == results[0]["plan"]["ref_matrices"]

"""GLM5_VALIDATE=topk: the tensor-parallel ranks' per-layer top-k are compared once per step (one all-gather
of int64 digests); a normal sharded run passes, a rank whose indexer sees a perturbed input trips it with
the layer and the step named. Two gloo processes on one machine, the plan's sharding + TorchGroup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel.agreement import TopkAgreement, TopkDisagreement, digest, enabled
from glm5.parallel.group import Single, TorchGroup

PERTURBED_LAYER = 1  # tiny's pattern is F F S F: layer 1 is a full layer whose top-k layer 2 reuses


def _rank(rank: int, size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=size)
    try:
        from glm5.parallel.plan import apply

        cfg = GLM5Config.from_preset("tiny")
        model = GLM5ForCausalLM(cfg, backend="reference").requires_grad_(False).eval()
        group = TorchGroup()
        apply(model, tp=group)
        check = TopkAgreement(group)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        outcome = {}
        with torch.no_grad():
            check.check(model(ids, return_topk=True).topk)  # step 0: ranks agree
            outcome["agreed_steps"] = check.step
            if rank == 1:
                indexer = model.model.layers[PERTURBED_LAYER].self_attn.indexer
                indexer.register_forward_pre_hook(lambda m, a: (a[0], -a[1], *a[2:]))
            try:
                check.check(model(ids, return_topk=True).topk)  # step 1: rank 1's indexer differs
            except TopkDisagreement as e:
                outcome["error"] = str(e)
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def test_tp2_topk_agreement_passes_then_trips_on_a_perturbed_rank(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path)), nprocs=2)
    for rank in range(2):  # both ranks see the gathered digests, so both raise the same error
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["agreed_steps"] == 1
        assert f"layer {PERTURBED_LAYER} " in out["error"] and "rank(s) [1]" in out["error"], out
        assert "at step 1 " in out["error"], out


def test_digest_sees_a_swap_and_a_changed_position():
    t = torch.tensor([[3, 7, -1], [0, 1, 2]], dtype=torch.int32)
    swapped = t[:, [1, 0, 2]]
    moved = t.clone()
    moved[1, 2] = 4
    d = digest([t, swapped, moved, t])
    assert d.dtype == torch.int64 and d.shape == (4,)
    assert d[0] == d[3] and d[0] != d[1] and d[0] != d[2]


def test_single_rank_checks_nothing_and_counts_steps():
    check = TopkAgreement(Single())
    check.check([torch.zeros(2, 2, dtype=torch.int32)])
    assert check.step == 1


@pytest.mark.parametrize("mode,on", [("", False), ("topk", True), ("values", True), ("reference", True)])
def test_modes_that_turn_it_on(monkeypatch, mode, on):
    monkeypatch.setenv("GLM5_VALIDATE", mode)
    assert enabled() is on

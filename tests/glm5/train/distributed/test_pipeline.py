"""Pipeline parallel (glm5/train/distributed/pipeline/schedule.py) on 2 gloo ranks: GPipe and 1F1B with the
MTP layer on the last stage and on its own stage, the loss of the loop's 'sparse' stage (LM + MTP + indexer
KL). Each rank's loss and gradients are bitwise those of the 1-process run over the same micro-batches (each
micro-batch's (lm + w * mtp + kl) / n backpropagated in order), and within 1e-5 relative of the
whole-batch run; 20 steps of 1F1B train."""

from __future__ import annotations

import json

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.loop.dsa import AttentionProbe
from glm5.train.loop.losses import lm_and_mtp
from tests.glm5.train._dist import spawn

B, S, N_MB, MTP_W = 4, 24, 2, 0.3
CONFIGS = [
    ("gpipe", "last"),
    ("1f1b", "last"),
    ("gpipe", "own"),
    ("1f1b", "own"),
    ("interleaved-1f1b", "own"),
]
TRAIN_STEPS = 20


def _model() -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(0)
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(seed))


def _loop_loss(model: GLM5ForCausalLM, probe: AttentionProbe, ids: torch.Tensor, parts: list | None = None):
    """The loop's 'sparse' stage loss (Trainer.train_step, kl_weight 1); its terms appended to parts."""
    probe.reset()
    losses = lm_and_mtp(model, ids, 1)
    kl = probe.kl_loss()
    if parts is not None:
        parts.append([float(losses.lm), float(losses.mtp), float(kl)])
    return losses.lm + MTP_W * losses.mtp + 1.0 * kl


def _emulate(ids: torch.Tensor, n: int) -> tuple[GLM5ForCausalLM, torch.Tensor, list[float]]:
    """The 1-process run over the same micro-batches, in micro-batch order; the mean lm / mtp / kl."""
    model = _model()
    probe = AttentionProbe(model, "sparse")
    total, parts = None, []
    for mb in ids.chunk(n):
        loss = _loop_loss(model, probe, mb, parts) / n
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return model, total, [sum(col) / n for col in zip(*parts, strict=True)]


def _warmup(ids: torch.Tensor) -> dict:
    """Stage 'warmup' (only the indexers train, on the KL alone), 1F1B against the micro-batch run."""
    from glm5.train.distributed.pipeline.schedule import build_pipeline

    models = [_model(), _model()]
    for model in models:
        for name, p in model.named_parameters():
            p.requires_grad_(".indexer." in name)
    ref, model = models
    probe = AttentionProbe(ref, "warmup")
    for mb in ids.chunk(N_MB):
        probe.reset()
        lm_and_mtp(ref, mb, 1)
        (1.0 * probe.kl_loss() / N_MB).backward()
    ref_grads = dict(ref.named_parameters())
    pipe = build_pipeline(
        model, None, "1f1b", N_MB, "own", probe=AttentionProbe(model, "warmup"), loss_stage="warmup"
    )
    pipe.step(ids)
    return {
        "with_grad": [n for n, p in pipe.named_parameters() if p.grad is not None],
        "grads_differ": [
            n
            for n, p in pipe.named_parameters()
            if (p.grad is None) != (ref_grads[n].grad is None)
            or (p.grad is not None and not torch.equal(p.grad, ref_grads[n].grad))
        ],
    }


def _whole(ids: torch.Tensor) -> tuple[GLM5ForCausalLM, torch.Tensor]:
    model = _model()
    loss = _loop_loss(model, AttentionProbe(model, "sparse"), ids)
    loss.backward()
    return model, loss.detach()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _agreement(rank: int, world: int, out_dir: str) -> None:
    from glm5.train.distributed.pipeline.schedule import build_pipeline

    ids = _ids()
    ref, ref_loss, ref_parts = _emulate(ids, N_MB)
    whole, whole_loss = _whole(ids)
    ref_grads = dict(ref.named_parameters())
    whole_grads = dict(whole.named_parameters())
    out = []
    for schedule, mtp_stage in CONFIGS:
        model = _model()
        probe = AttentionProbe(model, "sparse")
        pipe = build_pipeline(
            model, None, schedule, N_MB, mtp_stage, mtp_steps=1, mtp_weight=MTP_W, probe=probe
        )
        loss = pipe.step(ids)
        names = [n for n, _ in pipe.named_parameters()]
        rec = {
            "config": (schedule, mtp_stage),
            "n_params": len(names),
            "grads_missing": [
                n for n, p in pipe.named_parameters() if (p.grad is None) != (ref_grads[n].grad is None)
            ],
            "n_grads": sum(p.grad is not None for _, p in pipe.named_parameters()),
            "grads_differ": [
                n
                for n, p in pipe.named_parameters()
                if p.grad is not None and not torch.equal(p.grad, ref_grads[n].grad)
            ],
            "grad_rel_whole": max(
                _rel(p.grad, whole_grads[n].grad) for n, p in pipe.named_parameters() if p.grad is not None
            ),
            "names": names,
        }
        if loss is not None:
            rec["loss_equal"] = torch.equal(loss, ref_loss)
            rec["loss_rel_whole"] = _rel(loss, whole_loss)
            rec["parts"] = pipe.parts
            rec["ref_parts"] = ref_parts
        out.append(rec)
    out.append(
        {
            "warmup": _warmup(ids),
            "train_losses": _train(),
            "ref_n_grads": sum(p.grad is not None for p in ref.parameters()),
        }
    )
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


def _train() -> list[float]:
    """20 steps of 1F1B with the MTP layer on its own stage: Muon Split + AdamW over this rank's stage,
    gradients clipped by the norm over the whole pipeline; the losses, on the output stage's rank."""
    from glm5.train.distributed.pipeline.schedule import build_pipeline
    from glm5.train.muon.optimizer import build_optimizers

    model = _model()
    pipe = build_pipeline(
        model, None, "1f1b", N_MB, "own", mtp_steps=1, mtp_weight=MTP_W, probe=AttentionProbe(model, "sparse")
    )
    optimizers = build_optimizers(pipe, "muon-split", lr=1e-2, weight_decay=0.0)
    ids, losses = _ids(1), []
    for _ in range(TRAIN_STEPS):
        loss = pipe.step(ids)
        pipe.clip_grad_norm_(1.0)
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        if loss is not None:
            losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def agreement(tmp_path_factory) -> list[list[dict]]:
    out_dir = tmp_path_factory.mktemp("pipeline")
    spawn(_agreement, 2, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_parameter_on_exactly_one_rank(agreement):
    all_names = {n for n, _ in _model().named_parameters()}
    for i, config in enumerate(CONFIGS):
        per_rank = [set(r[i]["names"]) for r in agreement]
        assert not per_rank[0] & per_rank[1], config
        assert per_rank[0] | per_rank[1] == all_names, config


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=["-".join(c) for c in CONFIGS])
def test_gradients_and_loss_bitwise_equal_the_micro_batch_emulation(agreement, i):
    for rank, recs in enumerate(agreement):
        rec = recs[i]
        assert "train_losses" not in rec
        assert tuple(rec["config"]) == CONFIGS[i]
        assert rec["grads_missing"] == [], (rank, rec["grads_missing"])
        assert rec["grads_differ"] == [], (rank, rec["grads_differ"])
        assert rec["grad_rel_whole"] < 1e-5, (rank, rec["grad_rel_whole"])
    last = agreement[-1][i]
    assert last["loss_equal"]
    assert last["loss_rel_whole"] < 1e-6
    assert "loss_equal" not in agreement[0][i]  # only the output stage returns the loss
    parts = [last["parts"][k] for k in ("lm", "mtp", "kl")]
    assert parts == pytest.approx(last["ref_parts"], rel=1e-6)
    assert sum(r[i]["n_grads"] for r in agreement) == agreement[0][-1]["ref_n_grads"]


def test_twenty_steps_train(agreement):
    first, last = agreement[0][-1]["train_losses"], agreement[1][-1]["train_losses"]
    assert first == []  # only the output stage has the loss
    assert len(last) == TRAIN_STEPS
    assert last[-1] < 0.7 * last[0], last


def test_indexer_warmup_stage_gradients_bitwise(agreement):
    recs = [r[-1]["warmup"] for r in agreement]
    assert [r["grads_differ"] for r in recs] == [[], []]
    with_grad = [n for r in recs for n in r["with_grad"]]
    assert with_grad and all(".indexer." in n for n in with_grad)


def test_plan_passes_top_k_only_into_a_stage_that_starts_with_a_shared_layer():
    from glm5.train.distributed.pipeline.stages import plan_stages

    model = _model()  # tiny: indexer types full, full, shared, full
    last = plan_stages(model, 2, "last")
    assert [(s.start, s.stop) for s in last] == [(0, 2), (2, 4)]
    assert [(s.send_topk, s.recv_topk) for s in last] == [(True, False), (False, True)]
    assert [(s.final_norm, s.output) for s in last] == [(False, False), (True, True)]
    own = plan_stages(model, 2, "own")
    assert [(s.start, s.stop, s.final_norm, s.output) for s in own] == [
        (0, 4, True, False),
        (4, 4, False, True),
    ]
    assert not any(s.send_topk or s.recv_topk for s in own)
    cut = plan_stages(model, 2, "last", layers=[3, 1])  # cut before a full layer: no top-k crosses
    assert not any(s.send_topk or s.recv_topk for s in cut)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_stages": 6}, "stages: expected 1..4"),
        ({"n_stages": 2, "mtp_stage": "first"}, "mtp_stage: expected one of"),
        ({"n_stages": 2, "layers": [4, 0]}, "layers: expected 2 counts >= 1 summing to 4"),
    ],
)
def test_plan_refuses_a_bad_split_in_one_line(kwargs, message):
    from glm5.train.distributed.pipeline.stages import plan_stages

    with pytest.raises(ValueError, match=message) as err:
        plan_stages(_model(), **kwargs)
    assert "\n" not in str(err.value)

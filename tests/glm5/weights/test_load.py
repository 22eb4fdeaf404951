"""The vLLM plugin's loader (glm5/weights/load.py) fills a rank's slices of the plan from full checkpoint
tensors: the same parameters as the plan applied to the loaded model, for tensor and expert parallel; it
reports only completely loaded parameters and refuses foreign names. No vLLM and no processes needed:
loading exchanges nothing, so rank 1 of 2 is a group whose collectives are never called."""

from __future__ import annotations

import pytest
import torch

from glm5.core.checkpoint import hf_state_dict
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel.plan import apply
from glm5.weights import load as weights


class Rank1Of2:
    rank, size = 1, 2

    def all_reduce(self, x):
        raise AssertionError("loading must not communicate")

    all_gather = all_reduce


@pytest.fixture(scope="module")
def full():
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference").requires_grad_(False)
    model.init_weights(5)
    return model


def _sharded_meta(cfg, ep: bool):
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, backend="reference")
    names = weights.CheckpointNames(model)
    apply(model, tp=Rank1Of2(), ep=Rank1Of2() if ep else None)
    model.to_empty(device="cpu")
    return model.requires_grad_(False), names


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_rank_slices_equal_the_plan_applied_to_the_loaded_model(full, ep):
    model, names = _sharded_meta(full.config, ep)
    loaded = weights.load(model, names, hf_state_dict(full).items())
    ref = GLM5ForCausalLM(full.config, backend="reference").requires_grad_(False)
    ref.load_state_dict(full.state_dict())
    apply(ref, tp=Rank1Of2(), ep=Rank1Of2() if ep else None)
    want = dict(ref.named_parameters())
    assert loaded == set(want)
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def test_partial_update_reports_what_it_loaded_and_refuses_foreign_names(full):
    model, names = _sharded_meta(full.config, ep=True)
    sd = hf_state_dict(full)
    experts = [k for k in sd if ".mlp.experts." in k and k.startswith("model.layers.1.")]
    one = {k: sd[k] for k in experts if ".experts.0." in k}  # rank 1 holds experts 4-7: not its own
    assert weights.load(model, names, one.items()) == set()
    norm = "model.norm.weight"
    assert weights.load(model, names, [(norm, sd[norm])]) == {norm}
    with pytest.raises(ValueError, match=r"weights: 1 tensor\(s\) GLM-5 does not have"):
        weights.load(model, names, [("model.bogus.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="expected the full shape"):
        weights.load(model, names, [("lm_head.weight", torch.zeros(3, 3))])

"""Per-layer activation recompute and offload (glm5/train/loop/activations.py): gradients bitwise those of the
plain run, the offload bookkeeping against an independent count, and the training-signal hooks seeing
each layer once under recompute."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.train.loop.activations import checkpoint_layers, recomputing
from glm5.train.loop.dsa import AttentionProbe, ExpertBalancer
from glm5.train.loop.losses import lm_and_mtp
from tests.glm5._util import random_ids


def _model(backend: str = "reference") -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend=backend)
    model.init_weights(0)
    return model.train()


def _step(model: GLM5ForCausalLM, mtp_steps: int = 1):
    out = lm_and_mtp(model, random_ids(2, 24, seed=3), mtp_steps)
    total = out.lm + 0.3 * out.mtp if out.mtp is not None else out.lm
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_recompute_and_offload_gradients_are_bitwise_the_plain_ones(backend):
    loss, grads = _step(_model(backend))
    for mode in ("recompute", "offload"):
        model = _model(backend)
        checkpoint_layers(model, mode)
        got_loss, got = _step(model)
        assert torch.equal(got_loss, loss), mode
        assert got.keys() == grads.keys(), mode
        assert [n for n in grads if not torch.equal(got[n], grads[n])] == [], mode


def _saved_activations_per_layer(model: GLM5ForCausalLM) -> tuple[dict[int, int], dict[int, int]]:
    """Distinct non-parameter tensors autograd saves inside each main layer, and their bytes (a plain run
    observed from outside: module hooks for the layer, one saved-tensor hook for the whole forward)."""
    resident = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    current: list[int | None] = [None]
    seen: dict[tuple, torch.Tensor] = {}
    count, nbytes = defaultdict(int), defaultdict(int)
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        key = (current[0], ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        if current[0] is not None and ptr not in resident and key not in seen:
            seen[key] = t
            count[current[0]] += 1
            nbytes[current[0]] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(random_ids(2, 24, seed=3), labels=random_ids(2, 24, seed=3), return_logits=False)
    return dict(count), dict(nbytes)


def test_offload_moves_each_saved_activation_once_and_restores_them():
    want_count, want_bytes = _saved_activations_per_layer(_model())
    model = _model()
    stats = checkpoint_layers(model, "offload")
    n = model.config.num_hidden_layers
    assert sorted(stats) == list(range(len(model.model.layers)))  # main layers and the MTP layer
    _step(model, mtp_steps=0)
    assert {i: s.offloaded_tensors for i, s in stats.items() if i < n} == want_count
    assert {i: s.offloaded_bytes for i, s in stats.items() if i < n} == want_bytes
    for s in list(stats.values())[:n]:
        assert s.calls == 1 and s.recomputes == 0
        # what the backward read came back (the rest belongs to nodes no gradient reaches)
        assert 0 < s.restored_tensors <= s.offloaded_tensors
        assert 0 < s.restored_bytes <= s.offloaded_bytes
    with torch.no_grad():  # nothing saved, nothing moved
        model(random_ids(1, 8), return_logits=False)
    assert all(s.calls == 1 for i, s in stats.items() if i < n)


def test_recompute_runs_each_layer_again_but_signals_are_recorded_once():
    def signals(mode: str):
        model = _model()
        stats = checkpoint_layers(model, mode)
        probe, balancer = AttentionProbe(model, stage="warmup"), ExpertBalancer(model)
        out = lm_and_mtp(model, random_ids(2, 24, seed=3), 1)
        total = out.lm + probe.kl_loss()
        total.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return stats, len(probe.kl_terms), list(probe.max_logits), [x.clone() for x in balancer.load], grads

    _, kl_n, logits, load, grads = signals("none")
    stats, kl_n2, logits2, load2, grads2 = signals("recompute")
    assert all(s.calls == 1 and s.recomputes == 1 for s in stats.values())
    assert all(s.kept_input_bytes > 0 and s.offloaded_bytes == 0 for s in stats.values())
    assert (kl_n2, logits2) == (kl_n, logits)
    assert all(torch.equal(a, b) for a, b in zip(load2, load, strict=True))
    # the indexer KL term's graph lives inside the checkpointed layers: its gradients too are bitwise
    assert any(".indexer." in n for n in grads) and grads.keys() == grads2.keys()
    assert [n for n in grads if not torch.equal(grads2[n], grads[n])] == []
    assert not recomputing()


def test_none_undoes_a_mode_and_copies_keep_their_own_wrappers():
    model = _model()
    checkpoint_layers(model, "recompute")
    twin = copy.deepcopy(model)
    assert all(layer.forward.__self__ is layer for layer in twin.model.layers)
    assert checkpoint_layers(model, "none") == {}
    assert all("forward" not in vars(layer) and "predict" not in vars(layer) for layer in model.model.layers)


def test_an_unknown_mode_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"mode: expected one of none, recompute, offload, got 'swap'"):
        checkpoint_layers(_model(), "swap")

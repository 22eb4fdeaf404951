"""Resumed runs restore the RNG of whatever accelerator the machine has (an NPU through torch_npu, not only
CUDA), device by device in index order (device 10 after device 2)."""

from __future__ import annotations

import types

import torch

from glm5.train.loop import state


def test_accelerator_rng_states_round_trip_in_device_order(monkeypatch):
    saved = [torch.tensor([i], dtype=torch.uint8) for i in range(12)]
    restored = []
    npu = types.SimpleNamespace(get_rng_state_all=lambda: saved, set_rng_state_all=restored.extend)
    monkeypatch.setattr(state, "_accelerator", lambda: ("npu", npu))
    states = state.rng_state()
    assert {k for k in states if k != "cpu"} == {f"npu.{i}" for i in range(12)}
    torch.manual_seed(0)
    want = torch.rand(3)
    state.set_rng_state(dict(states, cpu=torch.manual_seed(0).get_state()))
    assert torch.equal(torch.rand(3), want)
    assert [int(t) for t in restored] == list(range(12))


def test_a_cpu_only_machine_saves_the_cpu_generator_alone(monkeypatch):
    monkeypatch.setattr(state, "_accelerator", lambda: None)
    assert list(state.rng_state()) == ["cpu"]

"""A resumed run draws the same random numbers as the run it continues: the checkpoint's RNG file restores
the CPU generator and the RNG of whatever accelerator the machine has (an NPU through torch_npu, not only
CUDA), device by device in index order (device 10 after device 2)."""

from __future__ import annotations

import types
from pathlib import Path

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


class _Model:
    def save_pretrained(self, d: Path) -> None:
        d.mkdir()


def test_resume_from_a_checkpoint_draws_the_same_cpu_numbers(tmp_path):
    torch.manual_seed(1234)
    torch.rand(7)  # a run part-way through its stream
    path = state.save_checkpoint(tmp_path, 3, _Model(), [], {"seed": 1234})
    want = torch.rand(5), torch.randint(0, 1000, (4,)), torch.randn(3)
    torch.manual_seed(99)  # a fresh process seeds from its options, not where the run was
    state.load_into(path, [])
    got = torch.rand(5), torch.randint(0, 1000, (4,)), torch.randn(3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)

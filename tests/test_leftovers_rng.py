"""A resumed run draws the same random numbers as the run it continues: the checkpoint's RNG file
restores the CPU generator (and the accelerator's, tested in tests/glm5/train/loop/test_rng_state.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from glm5.train.loop import state


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

"""The front door checks where the arguments live once per call (it checked them twice: before the value
checks, and again among the capability reasons)."""

from __future__ import annotations

import pytest
import torch

import backends
from backends.interface import Backend


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_one_device_check_per_call(name, monkeypatch):
    seen: list[str] = []
    check = Backend._device_reasons

    def counted(self, args):
        seen.append(self.name)
        return check(self, args)

    monkeypatch.setattr(Backend, "_device_reasons", counted)
    be = type(backends.get(name))()  # a fresh instance: its doors are built with the counted check
    be.topk(torch.tensor([[1.0, 3.0, 2.0]]), 2)
    assert seen == [name]


def test_reasons_still_name_a_misplaced_argument():
    x = torch.empty(2, 5, device="meta")
    why = backends.get("reference").reasons("topk", {"x": x, "k": 3, "lengths": None})
    assert why == ["x is on meta; this backend runs on cpu"]

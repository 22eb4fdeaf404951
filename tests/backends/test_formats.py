"""Signed int4 unpacking (SPEC 2.7) is written once, in the reference, and every backend and `quant`
use that one function through `backends.formats` (it was written in the reference, the cpu backend and
the Ascend adapters)."""

from __future__ import annotations

import importlib

import pytest
import torch

from backends.formats import pack_int4, unpack_int4


def test_unpack_int4_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = b.to(torch.int32) % 16, b.to(torch.int32) // 16
    want = torch.stack([lo, hi], dim=-1).flatten(-2)
    want = torch.where(want >= 8, want - 16, want).to(torch.int8)
    assert torch.equal(unpack_int4(b), want)
    assert unpack_int4(b).dtype == torch.int8


def test_unpack_int4_strided_and_batched():
    w = torch.randint(-8, 8, (3, 5, 8))
    packed = pack_int4(w)
    assert torch.equal(unpack_int4(packed), w.to(torch.int8))
    t = packed.transpose(0, 1)  # not contiguous
    assert torch.equal(unpack_int4(t), w.transpose(0, 1).to(torch.int8))


@pytest.mark.parametrize(
    "module", ["backends.cpu.w4a8_matmul", "backends.cpu.grouped_matmul", "backends.ascend._adapters"]
)
def test_backends_use_the_one_unpacking(module):
    assert importlib.import_module(module).unpack_int4 is unpack_int4

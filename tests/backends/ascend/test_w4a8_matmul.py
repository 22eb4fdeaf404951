"""w4a8_matmul: per-channel through the emulated npu_grouped_matmul (repacked int4), per-group kernel."""

from __future__ import annotations

import pytest
import torch

from backends.ascend import _adapters as ad
from backends.reference.w4a8_matmul import pack_int4


def _inputs(group_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_q = torch.randint(-128, 128, (9, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-8, 8, (21, 64), generator=g)  # N = 21: padded to 24 for the operator
    return x_q, torch.rand(9, generator=g), pack_int4(w), torch.rand(21, 64 // group_size, generator=g)


@pytest.mark.parametrize("group_size", [64, 16])
def test_matches_reference(backend, reference, group_size):
    args = _inputs(group_size)
    out = backend.w4a8_matmul(*args, group_size)
    assert torch.equal(out, reference.w4a8_matmul(*args, group_size))


def test_nibbles_packed_the_other_way_make_conformance_fail(backend, reference, monkeypatch):
    def reversed_nibbles(w):
        return _rev(w)

    def _rev(w):
        n = w.shape[-1]
        return orig(w.reshape(*w.shape[:-1], n // 8, 8).flip(-1).reshape(w.shape))

    orig = ad.pack_int4_along_n
    monkeypatch.setattr(ad, "pack_int4_along_n", reversed_nibbles)
    args = _inputs(64)
    assert not torch.equal(backend.w4a8_matmul(*args, 64), reference.w4a8_matmul(*args, 64))


def test_missing_scale_bias_makes_conformance_fail(backend, reference, monkeypatch):
    orig = ad.repack_w4_for_npu

    def no_bias(w_packed, w_scale):
        weight, bits, bias, n8 = orig(w_packed, w_scale)
        return weight, bits, torch.zeros_like(bias), n8

    monkeypatch.setattr(ad, "repack_w4_for_npu", no_bias)
    args = _inputs(64)
    assert not torch.equal(backend.w4a8_matmul(*args, 64), reference.w4a8_matmul(*args, 64))


def test_pack_along_n_round_trips_through_the_emulation():
    from backends.ascend.emulation.npu_grouped_matmul import unpack_int4_along_n

    w = torch.randint(-8, 8, (5, 24), dtype=torch.int8)
    packed = ad.pack_int4_along_n(w)
    assert packed.dtype == torch.int32 and packed.shape == (5, 3)
    assert torch.equal(unpack_int4_along_n(packed), w)
    assert (
        int(ad.pack_int4_along_n(torch.tensor([[1, 2, 0, 0, 0, 0, 0, -1]], dtype=torch.int8)))
        == 0xF0000021 - 2**32
    )  # element i in bits 4i

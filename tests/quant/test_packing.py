"""Exact round trips and bit layouts of every int4 packing the formats use (quant.md 2.1, 2.8)."""

from __future__ import annotations

import pytest
import torch

from backends.reference.w4a8_matmul import pack_int4, unpack_int4
from quant.formats.compressed_tensors import pack_int4_int32, unpack_int4_int32
from quant.formats.modelslim import pack_int4_rows, scale_bias, unpack_int4_rows


def _all_int4(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    q.view(-1)[:16] = torch.arange(-8, 8, dtype=torch.int8)  # every value, -8 included
    return q


@pytest.mark.parametrize("k", [8, 16, 40, 12, 6])  # 12, 6: padded to a multiple of 8
def test_compressed_tensors_int32_round_trip(k):
    q = _all_int4(6, k)
    packed = pack_int4_int32(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, (k + 7) // 8)
    assert torch.equal(unpack_int4_int32(packed, k), q)


def test_compressed_tensors_int32_bit_layout():
    """Nibble i of each int32 (bits 4i..4i+3) holds q[8j + i] + 8 (compressed_tensors pack_to_int32)."""
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8], [-1, 0, -8, 7, 0, 0, 0, 0]], dtype=torch.int8)
    want = [sum((int(v) + 8) << (4 * i) for i, v in enumerate(row)) for row in q]
    want = [w - (1 << 32) if w >= 1 << 31 else w for w in want]  # the uint32 bits read as int32
    assert pack_int4_int32(q).flatten().tolist() == want
    # padding is raw 0 (reads back as -8) and is cut by the stored shape
    head = sum((int(v) + 8) << (4 * i) for i, v in enumerate(q[0, :5]))
    assert pack_int4_int32(q[:, :5])[0, 0].item() == head


def test_modelslim_rows_round_trip_and_layout():
    q = _all_int4(8, 10)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int8 and packed.shape == (4, 10)
    assert torch.equal(unpack_int4_rows(packed), q)
    b = packed.view(torch.uint8).to(torch.int32)
    # byte (j, k) = (W[2j+1, k] << 4) | (W[2j, k] & 0xF), two's-complement nibbles
    want = ((q[1::2].to(torch.int32) & 0xF) << 4) | (q[0::2].to(torch.int32) & 0xF)
    assert torch.equal(b, want)


def test_modelslim_rows_need_even_n():
    with pytest.raises(ValueError, match="q: expected an even number"):
        pack_int4_rows(torch.zeros(3, 4, dtype=torch.int8))


def test_spec_packing_is_reused_round_trip():
    q = _all_int4(4, 32)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_scale_bias_per_channel_and_sliced():
    q = _all_int4(4, 32, seed=3)
    s = torch.tensor([0.5, 0.25, 2.0, 1.0])
    sb = scale_bias(q, s, sliced=False)
    assert sb.shape == (4, 1)
    torch.testing.assert_close(sb[:, 0], 8 * q.double().sum(1).float() * s)
    sl = scale_bias(q, s, sliced=True)
    assert sl.shape == (4, 16)
    torch.testing.assert_close(sl[:, 3], 8 * q[:, 6:8].double().sum(1).float() * s)
    torch.testing.assert_close(sl.sum(1), sb[:, 0])
    with pytest.raises(ValueError, match="K divisible by 16"):
        scale_bias(q[:, :24], s, sliced=True)

"""sparse_mla_attention through the emulated npu_sparse_flash_attention (GLM-5 shapes: 512 + 64)."""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from backends.ascend import _adapters as ad
from backends.ascend.emulation import OperatorRejected


def _inputs(paged: bool, heads: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [2, 2], [90, 40]
    if paged:
        lay = SeqLayout.from_lengths(q_lens, k_lens, block_size=16, block_order=[5, 0, 3, 2, 1, 4, 7, 6, 8])
        kv = torch.randn(9, 16, 576, generator=g).bfloat16()
    else:
        lay = SeqLayout(
            torch.tensor([0, 2, 4], dtype=torch.int32),
            torch.tensor(k_lens, dtype=torch.int32),
            cu_seqlens_k=torch.tensor([7, 100, 150], dtype=torch.int32),
        )
        kv = torch.randn(150, 576, generator=g).bfloat16()
    q = torch.randn(4, heads, 576, generator=g).bfloat16()
    idx = torch.randint(0, 40, (4, 24), generator=g, dtype=torch.int32)
    idx[0, ::3] = -1  # -1 in the middle
    idx[1, 5] = 95  # out of range for request 0
    idx[3] = -1  # empty row
    return q, kv, idx, lay


def _close(be, ref, inputs) -> bool:
    q, kv, idx, lay = inputs
    out, lse = be.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    r_out, r_lse = ref.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    fin = torch.isfinite(r_lse)
    return (
        torch.equal(torch.isinf(lse), ~fin)
        and torch.allclose(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
        and torch.allclose(lse[fin], r_lse[fin], rtol=8 / 65536, atol=1e-6)
    )


@pytest.mark.parametrize("paged", [False, True])
def test_matches_reference(backend, reference, paged):
    assert _close(backend, reference, _inputs(paged))
    assert backend.provider.calls["npu_sparse_flash_attention"] == 1


def _breaks(be, ref, inputs) -> bool:
    try:
        return not _close(be, ref, inputs)
    except OperatorRejected:
        return True


def test_dropped_head_padding_makes_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(ad, "pad_heads", lambda t, heads: t.contiguous())  # 3 heads: not a power of two
    assert _breaks(backend, reference, _inputs(False))


def test_unpacked_invalid_indices_make_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(ad, "valid_first", lambda idx, s: idx.to(torch.int32))
    assert _breaks(backend, reference, _inputs(True))


def test_lse_without_the_max_makes_conformance_fail(backend, reference, monkeypatch):
    monkeypatch.setattr(ad, "lse_from_softmax_stats", lambda m, s, h: torch.log(s[0, :, :h]))
    assert _breaks(backend, reference, _inputs(False))


@pytest.mark.parametrize("paged", [False, True])
def test_other_shapes_run_the_kernel(backend, reference, paged):
    q, kv, idx, lay = _inputs(paged)
    q, kv = q[..., :48].float(), kv[..., :48].float()  # fp32, d_qk=48: not the operator's
    kv[kv.abs() > 2.5] = float("nan")  # rows nobody names may hold NaN...
    named = kv.reshape(-1, 48)
    from backends.ascend.sparse_mla_attention import kernel_rows

    rows = kernel_rows(lay, kv, idx)
    named[rows[rows >= 0].long()] = torch.randn(int((rows >= 0).sum()), 48)  # ...the named ones are finite
    out, lse = backend.sparse_mla_attention(q, kv, idx, lay, 0.1, 32)
    r_out, r_lse = reference.sparse_mla_attention(q, kv, idx, lay, 0.1, 32)
    torch.testing.assert_close(out, r_out, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(lse, r_lse, rtol=2e-5, atol=1e-5)
    assert backend.provider.calls["npu_sparse_flash_attention"] == 0

"""Ascend's split-pool latent cache (backends/cache_layout.py): the backend declares PA_BSND pools and its
sparse_mla_attention reads them with no per-call cache copy (measured by _copies.CacheCopies); the
contract's one-tensor cache still copies the selected rows. Same outputs as the reference either way."""

from __future__ import annotations

import torch

from backends.ascend import AscendBackend
from backends.cache_layout import MLACacheLayout, MLAPools, write_rows
from tests.backends.ascend._copies import CacheCopies, record_operator
from tests.backends.ascend.test_sparse_mla_copies import ROW_BYTES, _decode

OP = "npu_sparse_flash_attention"


def _as_pools(kv: torch.Tensor) -> tuple[torch.Tensor, MLAPools]:
    """The allocator's buffer and the pools the backend declares, holding the rows of `kv`."""
    buffer = torch.empty_like(kv)
    pools = AscendBackend.mla_cache.view(buffer, kv.shape[1])
    assert isinstance(pools, MLAPools)
    write_rows(pools, torch.arange(kv.shape[0] * kv.shape[1]), kv.reshape(-1, kv.shape[-1]))
    return buffer, pools


def _run(backend, monkeypatch, followed, cache, q, idx, lay, return_lse):
    received: list = []
    monkeypatch.setattr(backend.provider.module, OP, record_operator(backend.provider, OP, received))
    with CacheCopies(followed) as copies:
        out = backend.ops["sparse_mla_attention"].fn(q, cache, idx, lay, 0.0625, 512, return_lse)
    return out, copies, received


def test_ascend_declares_pa_bsnd_pools():
    assert AscendBackend.mla_cache == MLACacheLayout(split=(512, 64), block_size=128)
    assert AscendBackend.mla_cache.shapes(7, 128, 576) == ((7, 128, 1, 512), (7, 128, 1, 64))


def test_split_pools_zero_copies_one_tensor_copies_the_selected_rows(backend, reference, monkeypatch):
    q, kv, idx, lay = _decode([2304, 2100], topk=256, block_size=128)
    assert "pools" in backend.capabilities("sparse_mla_attention").layouts
    t, k = idx.shape
    (one, _), one_copies, _ = _run(backend, monkeypatch, kv, kv, q, idx, lay, False)
    assert one_copies.bytes == t * k * ROW_BYTES, one_copies.ops  # the contract's one tensor: a copy

    buffer, pools = _as_pools(kv)
    (out, lse), copies, received = _run(backend, monkeypatch, buffer, pools, q, idx, lay, False)
    assert lse is None
    assert copies.bytes == 0 and not copies.ops, copies.ops  # no cache copy per call
    args, kwargs = received[0]["args"], received[0]["kwargs"]
    assert kwargs["layout_kv"] == "PA_BSND"
    assert args[1] is pools.latent and kwargs["key_rope"] is pools.rope  # the pools themselves
    assert any("PA_BSND split pools" in route for _, route in backend.provider.routes)
    r_out, _ = reference.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
    assert torch.equal(out, one)


def test_split_pools_with_lse_take_the_selected_rows(backend, reference, monkeypatch):
    """PA_BSND returns no lse: with return_lse=True the pools' selected rows are copied (as before)."""
    q, kv, idx, lay = _decode([2304, 2100], topk=256, q_lens=[2, 1], block_size=128)
    buffer, pools = _as_pools(kv)
    (out, lse), copies, received = _run(backend, monkeypatch, buffer, pools, q, idx, lay, True)
    assert received[0]["kwargs"]["layout_kv"] == "TND"
    assert copies.bytes == idx.numel() * ROW_BYTES, copies.ops
    r_out, r_lse = reference.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
    torch.testing.assert_close(lse, r_lse, rtol=8 / 65536, atol=1e-6)


def test_split_pools_through_the_front_door_match_the_reference(backend, reference):
    q, kv, idx, lay = _decode([300, 129], topk=64, q_lens=[2, 1], block_size=128)
    _, pools = _as_pools(kv)
    out, none = backend.sparse_mla_attention(q, pools, idx, lay, 0.0625, 512, return_lse=False)
    r_out, _ = reference.sparse_mla_attention(q, pools, idx, lay, 0.0625, 512)
    assert none is None
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)

"""What the sparse-attention adapter copies out of the latent cache (measured by _copies.CacheCopies).

Decode and MTP steps take the selected-rows route: T * topk rows reach the operator, whatever the
context length; prefill-like calls (more selections than keys) pack whole requests. return_lse=False
returns (out, None) with the same out. The documented PA_BSND path is checked on the emulation: it
takes a contiguous two-pool cache, and rejects the strided 512/64 views of the contract's 576-wide cache.
"""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from backends.ascend import _adapters as ad
from backends.ascend import sparse_mla_attention as sfa
from backends.ascend.emulation import OperatorRejected
from tests.backends.ascend._copies import CacheCopies, record_operator

OP = "npu_sparse_flash_attention"
ROW_BYTES = 576 * 2  # one bf16 latent row: 512 + 64


def _decode(k_lens, topk=256, q_lens=None, heads=4, seed=0, block_size=64):
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [1] * len(k_lens)
    need = sum(-(-s // block_size) for s in k_lens)
    order = torch.randperm(need + 3, generator=g)[:need].tolist()
    lay = SeqLayout.from_lengths(q_lens, k_lens, block_size=block_size, block_order=order)
    kv = torch.randn(need + 3, block_size, 576, generator=g).bfloat16()
    q = torch.randn(sum(q_lens), heads, 576, generator=g).bfloat16()
    rows = []
    for t_b, s_b in zip(q_lens, k_lens, strict=True):
        for i in range(t_b):
            vis = s_b - t_b + i + 1
            rows.append(torch.randperm(vis, generator=g)[:topk])
    idx = torch.stack(rows).to(torch.int32)
    idx[0, 5] = -1  # an invalid entry between valid ones
    return q, kv, idx, lay


def _measure(backend, monkeypatch, inputs, return_lse=True):
    q, kv, idx, lay = inputs
    received: list = []
    monkeypatch.setattr(backend.provider.module, OP, record_operator(backend.provider, OP, received))
    fn = backend.ops["sparse_mla_attention"].fn  # the adapter itself, inside the mode
    with CacheCopies(kv) as copies:
        out = fn(q, kv, idx, lay, 0.0625, 512, return_lse)
    return out, copies, received


@pytest.mark.parametrize("context", [2304, 6000])
def test_decode_copies_topk_rows_whatever_the_context(backend, reference, monkeypatch, context):
    inputs = _decode([context, 2100], topk=256)
    (out, lse), copies, received = _measure(backend, monkeypatch, inputs)
    t, k = inputs[2].shape
    assert copies.bytes == t * k * ROW_BYTES, copies.ops  # 2 x 256 rows, not 2304 + 2100 (or 8100)
    assert received[0]["args"][1].shape == (t * k, 1, 512)
    r_out, r_lse = reference.sparse_mla_attention(*inputs, 0.0625, 512)
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
    torch.testing.assert_close(lse, r_lse, rtol=8 / 65536, atol=1e-6)


def test_the_old_route_copies_the_whole_context(backend, monkeypatch):
    """The same decode call packing whole requests (the route before): the instrument sees it."""
    inputs = _decode([2304, 2100], topk=256)
    monkeypatch.setattr(sfa, "_compaction_cheaper", lambda lay, t, k: True)
    _, copies, _ = _measure(backend, monkeypatch, inputs)
    # the packed rows, then their 512 and 64 columns made contiguous
    assert copies.bytes == 2 * (2304 + 2100) * ROW_BYTES, copies.ops


def test_prefill_packs_requests_when_that_copies_less(backend, reference, monkeypatch):
    inputs = _decode([2100, 2050], topk=2048, q_lens=[2, 2])  # 4 x 2048 selections > 4150 keys
    calls = []
    monkeypatch.setattr(ad, "compact_keys", lambda *a: calls.append(1) or _COMPACT(*a))
    (out, lse), copies, _ = _measure(backend, monkeypatch, inputs)
    assert calls and copies.bytes == 2 * 4150 * ROW_BYTES
    r_out, r_lse = reference.sparse_mla_attention(*inputs, 0.0625, 512)
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)


_COMPACT = ad.compact_keys


def test_return_lse_false_gives_none_and_the_same_out(backend):
    q, kv, idx, lay = _decode([2304, 2100], topk=256, q_lens=[2, 1])
    out, lse = backend.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    out2, none = backend.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512, return_lse=False)
    assert none is None and lse.shape == (3, 4) and torch.equal(out, out2)


# -- the documented PA_BSND path of the emulated operator ----------------------------------------------


def _pa_call(module, q, key, key_rope, idx, lay, **over):
    kw = dict(
        block_table=lay.block_table,
        actual_seq_lengths_query=lay.cu_seqlens_q[1:].contiguous(),
        actual_seq_lengths_kv=lay.seqlens_k,
        query_rope=q[..., 512:].contiguous(),
        key_rope=key_rope,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=0,
        attention_mode=2,
    )
    kw |= over
    return module.npu_sparse_flash_attention(q[..., :512].contiguous(), key, key, idx[:, None], 0.0625, **kw)


def test_pa_bsnd_takes_a_two_pool_cache_and_rejects_the_strided_views(backend, reference):
    q, kv, idx, lay = _decode([2304, 2100], topk=256)
    idx = ad.valid_first(idx, lay.seqlens_k.to(torch.int64))
    mod = backend.provider.module
    with pytest.raises(OperatorRejected, match="key: expected a contiguous tensor"):
        _pa_call(mod, q, kv[..., None, :512], kv[..., None, 512:], idx, lay)
    pools = kv[..., None, :512].contiguous(), kv[..., None, 512:].contiguous()  # vllm-ascend's layout
    out, smax, ssum = _pa_call(mod, q, *pools, idx, lay)
    assert smax.numel() == 0 and ssum.numel() == 0
    r_out, _ = reference.sparse_mla_attention(q, kv, idx, lay, 0.0625, 512)
    torch.testing.assert_close(out.float(), r_out.float(), rtol=3 / 128, atol=8e-4)
    with pytest.raises(OperatorRejected, match="return_softmax_lse"):
        _pa_call(mod, q, *pools, idx, lay, return_softmax_lse=True)
    with pytest.raises(OperatorRejected, match="actual_seq_lengths_kv"):  # cumulative: past the table
        _pa_call(mod, q, *pools, idx, lay, actual_seq_lengths_kv=ad.cumulative(lay.seqlens_k))
    short = lay.block_table[:, :1].contiguous()
    with pytest.raises(OperatorRejected, match="actual_seq_lengths_kv"):
        _pa_call(mod, q, *pools, idx, lay, block_table=short)


@pytest.mark.parametrize("return_lse", [True, False])
def test_opcheck_on_the_operator_route(backend, return_lse):
    """The custom op's registration (fake, schema, AOT dispatch) holds on the operator route too (the
    runtime opcheck sample is fp32 / d_qk=40, which takes the kernel)."""
    from backends.contract import library

    q, kv, idx, lay = _decode([2304, 2100], topk=256, q_lens=[2, 1])
    args = dict(q=q, kv_cache=kv, indices=idx, layout=lay, sm_scale=0.0625, d_v=512, return_lse=return_lse)
    op = "sparse_mla_attention"
    torch.library.opcheck(library.CUSTOM_OPS[op], library.custom_op_args(op, args, backend.key))
    assert any("selected rows" in route for _, route in backend.provider.routes)

"""The ascend backend's ops in the layout-invariant mode (SPEC 12): each gives the reference's bits in the
mode (its exact products on the "ascend" engine, kernels_ascend/invariant_gemm.py, in triton-ascend's
interpreter), where its normal route (the emulated fused operators, the kernels) does not."""

from __future__ import annotations

import pytest
import torch

from backends import SeqLayout
from backends.cache_layout import MLAPools
from glm5.parallel.invariant import layout_invariant, require
from kernels_ascend import LAUNCHES


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _in_mode(be, op: str, *args):
    with layout_invariant(be):
        return getattr(be, op)(*args)


BLOCK = 16


def _layout(paged: bool, q_lens, k_lens, block_size: int = BLOCK) -> SeqLayout:
    if paged:
        blocks = sum(-(-s // block_size) for s in k_lens)
        return SeqLayout.from_lengths(
            q_lens, k_lens, block_size=block_size, block_order=list(range(blocks))[::-1]
        )
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = [5 + sum(k_lens[:i]) + 3 * i for i in range(len(k_lens))]  # gaps between requests
    return SeqLayout(
        cu_q,
        torch.tensor(k_lens, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(starts + [starts[-1] + k_lens[-1]], dtype=torch.int32),
    )


def _cache(lay: SeqLayout, rows: int, width: int, dtype, g) -> torch.Tensor:
    if lay.kind == "paged":
        return torch.randn(int(lay.block_table.max()) + 1, BLOCK, width, generator=g).to(dtype)
    return torch.randn(rows, width, generator=g).to(dtype)


def test_require_passes(backend):
    require(backend)


# -- sparse_mla_attention ----------------------------------------------------------------------------------
def _attention(
    paged: bool, d_qk: int, d_v: int, heads: int, dtype, q_lens=(3, 2), k_lens=(230, 210), topk=64
):
    g = _g(d_qk + heads)
    lay = _layout(paged, list(q_lens), list(k_lens))
    kv = _cache(lay, sum(k_lens) + 20, d_qk, dtype, g)
    t = sum(q_lens)
    q = torch.randn(t, heads, d_qk, generator=g).to(dtype)
    idx = torch.randint(0, min(k_lens), (t, topk), generator=g, dtype=torch.int32)
    idx[0, ::5] = -1  # -1 in the middle
    if t > 1:
        idx[1, 3] = max(k_lens) + 7  # past the request's keys
        idx[-1] = -1  # a row with no valid key
    return q, kv, idx, lay


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_attention_is_the_references_bits(backend, reference, paged, dtype):
    q, kv, idx, lay = _attention(paged, 48, 32, 3, dtype)
    before = LAUNCHES["invariant_gemm"]
    out, lse = _in_mode(backend, "sparse_mla_attention", q, kv, idx, lay, 0.15, 32)
    assert LAUNCHES["invariant_gemm"] > before
    r_out, r_lse = _in_mode(reference, "sparse_mla_attention", q, kv, idx, lay, 0.15, 32)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    assert torch.isneginf(lse[-1]).all() and not out[-1].any()
    n_out, n_lse = backend.sparse_mla_attention(q, kv, idx, lay, 0.15, 32)  # the kernel's own sums
    assert not (torch.equal(n_out, r_out) and torch.equal(n_lse, r_lse))


@pytest.mark.parametrize("pools", [False, True])
def test_sparse_mla_attention_at_glm5_widths_is_the_references_bits(backend, reference, pools):
    """576 = 512 latent + 64 RoPE, d_v 512, bf16: the shapes npu_sparse_flash_attention serves normally."""
    q, kv, idx, lay = _attention(True, 576, 512, 4, torch.bfloat16, q_lens=(2,), k_lens=(230,))
    cache = MLAPools.of(kv, 512) if pools else kv
    r_cache = cache.joined() if pools else kv
    out, lse = _in_mode(backend, "sparse_mla_attention", q, cache, idx, lay, 576**-0.5, 512)
    assert backend.provider.calls["npu_sparse_flash_attention"] == 0  # no exact mode: not called in it
    r_out, r_lse = _in_mode(reference, "sparse_mla_attention", q, r_cache, idx, lay, 576**-0.5, 512)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    n_out, n_lse = backend.sparse_mla_attention(q, cache, idx, lay, 576**-0.5, 512)  # the emulated operator
    assert not (torch.equal(n_out, r_out) and torch.equal(n_lse, r_lse))


# -- indexer_topk --------------------------------------------------------------------------------------------
def _indexer(paged: bool, d: int, dtype):
    g = _g(d)
    q_lens, k_lens = [3, 2], [230, 205]
    lay = _layout(paged, q_lens, k_lens)
    cache = _cache(lay, sum(k_lens) + 20, d, dtype, g)
    flat = cache.view(-1, d)
    rows = [int(r) for r in lay.physical_rows(0, torch.arange(230), cache)]
    flat[rows[150]] = flat[rows[40]]  # the same key twice: equal logits, the lower index first
    q = torch.randn(5, 4, d, generator=g).to(dtype)
    w = torch.randn(5, 4, generator=g)
    return q, cache, w, lay


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (40, torch.float32)])
def test_indexer_topk_is_the_references_selection(backend, reference, monkeypatch, paged, d, dtype):
    from backends.ascend import _adapters as ad
    from backends.ascend import indexer_topk as mod
    from backends.ascend.indexer_logits import kernel_logits
    from backends.ascend.indexer_topk import exact_logits

    monkeypatch.setattr(mod, "KEY_CHUNK", 96)  # 230 keys: three exact products per request
    q, cache, w, lay = _indexer(paged, d, dtype)
    got = _in_mode(backend, "indexer_topk", q, cache, w, lay, 64)
    assert backend.provider.calls["npu_lightning_indexer"] == 0
    assert torch.equal(got, _in_mode(reference, "indexer_topk", q, cache, w, lay, 64))
    assert (got[:, :64] >= 0).all()
    tokens = torch.arange(5)
    with layout_invariant(reference):
        exact, visible = exact_logits(q, cache, w, lay, tokens)
        want = reference.indexer_logits(q, cache, w, lay)
    assert torch.equal(exact, want) and torch.equal(visible, ad.causal_visible(lay))
    normal = kernel_logits(q, cache, w, lay, tokens)[0]  # the normal route's scores: other sums
    assert not torch.equal(normal, want)


# -- grouped_matmul ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_is_the_references_bits(backend, reference, dtype):
    g = _g(3)
    x = torch.randn(11, 300, generator=g).to(dtype)
    w = (0.05 * torch.randn(4, 48, 300, generator=g)).to(dtype)
    offs = torch.tensor([0, 4, 4, 9, 10], dtype=torch.int64)  # an empty expert, a row past the last
    got = _in_mode(backend, "grouped_matmul", x, w, offs)
    want = _in_mode(reference, "grouped_matmul", x, w, offs)
    assert torch.equal(got, want)
    if dtype == torch.float32:  # the kernel's fp32 sums (bf16 rounds the difference away here)
        assert not torch.equal(backend.grouped_matmul(x, w, offs), want)


def test_grouped_matmul_w8a8_is_the_references_bits(backend, reference):
    g = _g(4)
    x = torch.randint(-127, 128, (7, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (2, 40, 64), generator=g, dtype=torch.int8)
    xs, ws = torch.rand(7, generator=g) / 50, torch.rand(2, 40, generator=g) / 50
    offs = torch.tensor([0, 3, 7], dtype=torch.int64)
    args = (x, w, offs, xs, ws, None, torch.bfloat16)
    assert torch.equal(
        _in_mode(backend, "grouped_matmul", *args), _in_mode(reference, "grouped_matmul", *args)
    )


# -- silu_and_mul, topk --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_the_references_bits(backend, reference, dtype):
    x = (4 * torch.randn(64, 2 * 96, generator=_g(5))).to(dtype)
    want = _in_mode(reference, "silu_and_mul", x)
    assert torch.equal(_in_mode(backend, "silu_and_mul", x), want)
    if dtype == torch.float32:  # torch's sigmoid against the fixed formula: some last bits differ
        assert not torch.equal(backend.silu_and_mul(x), want)


def test_topk_is_the_references_selection(backend, reference):
    x = torch.randn(6, 230, generator=_g(6))
    x[0, 100] = x[0, 7]  # a tie: the lower index first
    lengths = torch.tensor([230, 200, 64, 10, 0, 229])
    got = _in_mode(backend, "topk", x, 64, lengths)
    want = _in_mode(reference, "topk", x, 64, lengths)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# -- the model -----------------------------------------------------------------------------------------------
def test_the_tiny_model_in_the_mode_is_the_references_bits():
    """Logits and every layer's indexer top-k of the tiny preset (weights with many equal products and
    near-ties at the top-k cut) in the mode: the ascend backend's are the reference backend's, batch 2 and
    a row's prefill + decode on the backend's own cache alike; the normal mode's are not."""
    from tests.glm5.test_invariant_layouts import _decoded, _forward, _ids, _model, _same

    ids = _ids()[:2]
    want = _forward(_model("reference"), ids, True)
    model = _model("ascend")
    assert _same(_forward(model, ids, True), want)
    assert not _same(_forward(model, ids, False), want)
    one = _decoded(model, ids[1:], 37, True)  # 37 tokens prefilled, then 3 decode steps
    assert _same(one, (want[0][1:], [t[40:] for t in want[1]]))

"""fp8_mla_cache_quant / fp8_sparse_mla_attention (SPEC 7.6, 7.7) restated from FlashMLA's
`tests/quant.py` (quantize_k_cache / dequantize_k_cache) and `tests/ref.py` (sparse decode reference)."""

from __future__ import annotations

import torch

from backends.layout import SeqLayout
from backends.reference.fp8_format import mla_dequantize_rows
from backends.reference.fp8_mla_cache_quant import fp8_mla_cache_quant, write_rows
from backends.reference.fp8_sparse_mla_attention import fp8_sparse_mla_attention


def flashmla_quantize(kv: torch.Tensor) -> torch.Tensor:
    """quantize_k_cache with dv=512, tile 128, for a [N, 576] bf16 input -> uint8 [N, 656]."""
    n = kv.shape[0]
    out = torch.empty(n, 656, dtype=torch.uint8)
    nope, rope = kv[:, :512].float(), kv[:, 512:]
    scales = torch.empty(n, 4)
    for i in range(4):
        tile = nope[:, i * 128 : (i + 1) * 128]
        s = torch.pow(2, torch.clamp_min(tile.abs().amax(dim=-1) / 448.0, 1e-4).log2().ceil())
        scales[:, i] = s
        out[:, i * 128 : (i + 1) * 128] = (tile / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, 512:528] = scales.view(torch.uint8)
    out[:, 528:] = rope.bfloat16().contiguous().view(torch.uint8)
    return out


def flashmla_dequantize(rows: torch.Tensor) -> torch.Tensor:
    nope = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16)
    return torch.cat([(nope * scale.repeat_interleave(128, 1)).bfloat16(), rope], dim=1)


def test_cache_rows_match_flashmla_quantizer_bitwise():
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(37, 576, generator=g) / 10).clamp(-1, 1).bfloat16()
    kv[3, :128] = 0  # floor scale
    kv[4, 128:256] *= 1e4
    rows = fp8_mla_cache_quant(kv)
    assert rows.shape == (37, 656) and rows.dtype == torch.uint8
    assert torch.equal(rows, flashmla_quantize(kv))
    assert torch.equal(mla_dequantize_rows(rows), flashmla_dequantize(rows))
    assert torch.equal(mla_dequantize_rows(rows)[:, 512:], kv[:, 512:])


def flashmla_sparse_decode_ref(q, kv_deq, indices, sm_scale):
    """tests/ref.py: gather with clamp_min(0), NaN -> 0, invalid -> -inf, fp32 softmax; empty rows out 0."""
    g = kv_deq[indices.clamp_min(0).long()].float().nan_to_num(0.0)  # [T, topk, 576]
    p = torch.einsum("thd,tkd->thk", q.float(), g) * sm_scale
    p = p.masked_fill((indices < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(p, dim=-1)
    prob = torch.exp(p - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", prob, g[..., :512]), lse


def test_paged_attention_matches_flashmla_reference():
    g = torch.Generator().manual_seed(1)
    bs, nb = 61, 80
    k_lens, q_lens = [2300, 1200], [2, 1]
    layout = SeqLayout.from_lengths(q_lens, k_lens, block_size=bs, block_order=list(range(nb))[::-1])
    cache = torch.full((nb, bs, 656), 0xFF, dtype=torch.uint8)  # unused rows are NaN everywhere
    flat_rows = []
    for b, s in enumerate(k_lens):
        kv = (torch.randn(s, 576, generator=g) / 10).clamp(-1, 1).bfloat16()
        slots = layout.physical_rows(b, torch.arange(s), cache)
        write_rows(cache, slots, fp8_mla_cache_quant(kv))
        flat_rows.append(slots)
    t, h, topk = 3, 16, 2048
    q = torch.randn(t, h, 576, generator=g).clamp(-1, 1).bfloat16()
    idx = torch.full((t, topk), -1, dtype=torch.int32)
    for row, n in enumerate([2299, 2300, 1200]):
        take = torch.randperm(n, generator=g)[: min(topk, n)]
        idx[row, : take.numel()] = take.to(torch.int32)
    idx[2, :] = -1  # one all-invalid row
    out, lse = fp8_sparse_mla_attention(q, cache, idx, layout, 576**-0.55, 512)
    # the same through physical slots (FlashMLA's indices) on the dequantized flat cache
    kv_deq = mla_dequantize_rows(cache.view(-1, 656))
    phys = idx.clone().long()
    for row, b in enumerate([0, 0, 1]):
        ok = phys[row] >= 0
        phys[row, ok] = flat_rows[b][phys[row, ok]]
    ref_out, ref_lse = flashmla_sparse_decode_ref(q, kv_deq, phys, 576**-0.55)
    torch.testing.assert_close(out.float(), ref_out, rtol=2.01 / 128, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=8.01 / 65536, atol=1e-6)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()

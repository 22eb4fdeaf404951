"""cpu backend: fp8_sparse_mla_attention (SPEC 7.7): the gather + batched-GEMM attention of
`backends/cpu/sparse_mla_attention.py` on FlashMLA's 656-byte FP8 rows. Per block of queries, the rows
their indices name are gathered as bytes and only those are de-quantized (as FlashMLA's SM90 kernel and
the reference do: bf16(bf16(code) * bf16(scale)), RoPE as stored, both exact in fp32), then scores, an
in-place softmax and probabilities x latent values as two bmm's. Rows no valid index names are never
decoded (unused cache bytes may be NaN). fp32 sums in GEMM order: within the attention tolerance.
"""

from __future__ import annotations

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS
from backends.cpu._attention import query_blocks, softmax_values
from backends.cpu._cache import flat
from backends.cpu._fp8 import decode
from backends.cpu._parallel import run_blocks
from backends.cpu._workspace import buffer
from backends.formats import BLOCK
from backends.layout import SeqLayout

LATENT, ROPE, TILES = 512, 64, 4
#: bound the gathered [tq, topk, 576] fp32 keys (elements): 16 MiB
GATHER_ELEMS = 1 << 22


def dequantize(raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """uint8 rows [R, 656] -> fp32 [R, 576] into `out`: FlashMLA's read of the V3.2 row."""
    r = raw.shape[0]
    lat = out[:, :LATENT].view(r, TILES, BLOCK)
    decode(raw[:, :LATENT].view(r, TILES, BLOCK), out=lat)
    scale = raw[:, LATENT : LATENT + 4 * TILES].contiguous().view(torch.float32)
    lat.mul_(scale.bfloat16().float()[..., None])
    lat.copy_(lat.bfloat16())  # one product of <= 12 significant bits, rounded once to bf16
    out[:, LATENT:] = raw[:, LATENT + 4 * TILES :].contiguous().view(torch.bfloat16)
    return out


def _block(q, cache, rows, valid, d_v):
    """q [tq, H, 576] fp32 already times sm_scale, rows / valid [tq, n] -> (out [tq, H, d_v], lse [tq, H])."""
    tq, n = rows.shape
    raw = flat(cache).index_select(0, rows.reshape(-1))
    keys = dequantize(raw, buffer("fp8mla.keys", tq * n * q.shape[-1]).view(tq * n, -1)).view(tq, n, -1)
    if not bool(valid.all()):
        keys.masked_fill_(~valid[..., None], 0)
    return softmax_values(torch.bmm(q, keys.transpose(1, 2)), keys, valid, d_v)


@torch.no_grad()
def fp8_sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, 576]; kv_cache uint8 ragged [rows, 656] / paged [nb, bs, 656]; indices int32 [T, topk].
    Returns (out [T, H, 512] dtype of q, lse [T, H] fp32 or None).
    Semantics: backends/reference/fp8_sparse_mla_attention.py (SPEC 7.7)"""
    t, h, d_qk = q.shape
    n = indices.shape[1]
    out = torch.zeros(t, h, d_v, dtype=torch.float32)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32)
    step = max(1, GATHER_ELEMS // max(1, n * d_qk))
    qf = q.float() * sm_scale

    def block(args) -> None:
        a, z, rows, valid = args
        out[a:z], lse[a:z] = _block(qf[a:z], kv_cache, rows, valid, d_v)

    run_blocks(block, query_blocks(layout, indices, kv_cache, step))  # one intra-op thread per block
    return out.to(q.dtype), (lse if return_lse else None)


IMPL = OpImpl(
    fp8_sparse_mla_attention,
    OpCaps(FLOATS, FP8_KINDS, run_to_run=True, batch_invariant=True),
)

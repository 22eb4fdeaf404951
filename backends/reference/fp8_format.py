"""FP8 (e4m3) number formats shared by the FP8 ops (SPEC 7): the cast, group scales, block layouts and
FlashMLA's 656-byte V3.2 latent-cache row. Plain torch, CPU, the definitions every backend matches.

    e4m3 ("float8_e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448, no inf; 0x7f / 0xff NaN.
    cast(y)    = e4m3(clamp(y, -448, 448)), round to nearest even (torch's `.to(float8_e4m3fn)` on CPU
                 is RNE and saturates; GPU casts differ out of range, so every producer clamps first)
    scale(amax)= max(amax, eps) / 448                         (fp32 division)
    ue8m0      = 2 ** ceil(log2(scale))                       a power of two, rounded up, stored as fp32
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: DeepSeek's `act_quant` floor on amax; vLLM's `per_token_group_quant_fp8` uses 1e-10.
EPS_DEEPSEEK = 1e-4
EPS_VLLM = 1e-10
BLOCK = 128  # activation groups 1 x 128, weight blocks 128 x 128

# FlashMLA V3.2 FP8 latent cache, per token: 512 e4m3 | 4 fp32 scales (one per 128) | 64 bf16 RoPE
MLA_LATENT = 512
MLA_ROPE = 64
MLA_TILES = MLA_LATENT // BLOCK
MLA_ROW_BYTES = MLA_LATENT + 4 * MLA_TILES + 2 * MLA_ROPE  # 656
MLA_D_QK, MLA_D_V = MLA_LATENT + MLA_ROPE, MLA_LATENT  # q [T, H, 576], out [T, H, 512]
MLA_SCALE_FLOOR = 1e-4  # FlashMLA tests/quant.py: 2^ceil(log2(max(amax / 448, 1e-4)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cast_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3: saturate to +-448, then round to nearest even. NaN stays NaN."""
    return y.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(s)) for positive finite fp32 s, exactly (from the exponent bits, no log2 rounding)."""
    m, e = torch.frexp(s.float())  # s = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), torch.where(m == 0.5, e - 1, e))


def group_scale(amax: torch.Tensor, eps: float, ue8m0: bool) -> torch.Tensor:
    """fp32 scale of a group from its fp32 amax: max(amax, eps) / 448, then optionally UE8M0."""
    s = torch.clamp(amax.float(), min=eps) / E4M3_MAX
    return pow2_ceil(s) if ue8m0 else s


def expand_groups(scale: torch.Tensor, k: int, group: int = BLOCK) -> torch.Tensor:
    """[..., ceil(K/group)] per-group values -> [..., K] per column (partial last group included)."""
    return scale.repeat_interleave(group, dim=-1)[..., :k]


def expand_blocks(scale_inv: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """[ceil(N/b), ceil(K/b)] block multipliers -> [N, K] (works on a leading expert dim too)."""
    return scale_inv.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


def quantize_weight_blocks(w: torch.Tensor, eps: float = EPS_DEEPSEEK) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] -> (e4m3 [..., N, K], weight_scale_inv fp32 [..., ceil(N/128), ceil(K/128)])
    with one scale per 128 x 128 block: scale_inv = max(amax, eps) / 448 (DeepSeek's checkpoint recipe)."""
    *lead, n, k = w.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    pad = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    pad[..., :n, :k] = w.float()
    blocks = pad.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    s = group_scale(amax, eps, ue8m0=False)
    q = cast_e4m3(w.float() / expand_blocks(s, n, k))
    return q, s


def dequantize_weight_blocks(w_q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W = W_fp8 * scale_inv[n // 128, k // 128] in fp32 (the checkpoint's definition)."""
    n, k = w_q.shape[-2:]
    return w_q.float() * expand_blocks(scale_inv.float(), n, k)


# -- FlashMLA's 656-byte cache row --------------------------------------------------------------------------


def mla_row_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 [..., 656] -> (latent e4m3 [..., 512], scales fp32 [..., 4], rope bf16 [..., 64]) as copies."""
    flat = rows.reshape(-1, MLA_ROW_BYTES).contiguous()
    lat = flat[:, :MLA_LATENT].view(E4M3)
    sc = flat[:, MLA_LATENT : MLA_LATENT + 4 * MLA_TILES].contiguous().view(torch.float32)
    rope = flat[:, MLA_LATENT + 4 * MLA_TILES :].contiguous().view(torch.bfloat16)
    lead = rows.shape[:-1]
    return lat.reshape(*lead, MLA_LATENT), sc.reshape(*lead, MLA_TILES), rope.reshape(*lead, MLA_ROPE)


def mla_dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 656] -> bf16 [..., 576] as FlashMLA's SM90 kernel reads it:
    latent[j] = bf16(fp8[j]) * bf16(scale[j // 128]) rounded to bf16 (exact for power-of-two scales);
    the 64 RoPE values as stored."""
    lat, sc, rope = mla_row_parts(rows)
    s = sc.bfloat16().float().repeat_interleave(BLOCK, dim=-1)
    latent = (lat.float() * s).bfloat16()  # one product of <= 12 significant bits, rounded once
    return torch.cat([latent, rope], dim=-1)


def mla_simulated_rows(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """The 656-byte row's numerics at any width, as values of kv's dtype (for models whose widths are not
    GLM-5's 512 + 64, which the row cannot hold): kv[..., :d_v] in tiles of min(128, d_v) cast to e4m3 with
    scale 2^ceil(log2(max(amax / 448, 1e-4))), de-quantized and rounded to bf16; the rest rounded to bf16.
    At 512 + 64 it equals `mla_dequantize_rows` of the quantized rows (as DeepSeek V3.2's demo simulates
    its FP8 cache)."""
    tile = min(BLOCK, d_v)
    lat = kv[..., :d_v].float()
    shape = lat.shape
    t = lat.reshape(*shape[:-1], -1, tile)
    s = pow2_ceil(torch.clamp(t.abs().amax(dim=-1, keepdim=True) / E4M3_MAX, min=MLA_SCALE_FLOOR))
    deq = (cast_e4m3(t / s).float() * s).bfloat16().float().reshape(shape)
    return torch.cat([deq, kv[..., d_v:].bfloat16().float()], dim=-1).to(kv.dtype)


# -- the FP8 indexer cache (vLLM's DeepSeek-V3.2 block layout) ------------------------------------------
# Per key: D_I e4m3 bytes and one fp32 UE8M0 scale (132 bytes for D_I = 128). A paged cache uint8
# [nb, bs, D_I + 4] holds, per block, its bs keys' e4m3 values first, then their bs scales; a ragged cache
# uint8 [rows, D_I + 4] is one block of `rows` keys. Keys are quantized once, when written.

INDEX_SCALE_BYTES = 4


def index_cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ragged [rows, D_I + 4] / paged [nb, bs, D_I + 4] -> views into the same memory: (keys e4m3
    [rows, D_I] / [nb, bs, D_I], scales fp32 [rows] / [nb, bs])."""
    blocks = cache.unsqueeze(0) if cache.dim() == 2 else cache
    nb, bs, w = blocks.shape
    d = w - INDEX_SCALE_BYTES
    flat = blocks.view(nb, -1)  # a view: writes land in the cache
    keys = flat[:, : bs * d].view(nb, bs, d).view(E4M3)
    scales = flat[:, bs * d :].view(torch.float32)
    return (keys[0], scales[0]) if cache.dim() == 2 else (keys, scales)


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys [S, D_I] float -> (e4m3 [S, D_I], fp32 UE8M0 scales [S]): one group per key, DeepSeek's
    floor (the key half of `fp8_indexer_logits.quantize_indexer_inputs`)."""
    ks = group_scale(k.float().abs().amax(dim=-1), EPS_DEEPSEEK, True)
    return cast_e4m3(k.float() / ks[..., None]), ks


def write_index_cache(cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor) -> None:
    """Quantize keys [T, D_I] into physical rows (int64 [T]: block * bs + offset) of an FP8 indexer cache."""
    keys, scales = index_cache_views(cache)
    k8, ks = quantize_index_keys(k)
    if cache.dim() == 3:  # a block keeps its keys, then its scales: row r is (r // bs, r % bs)
        blk, off = rows // keys.shape[1], rows % keys.shape[1]
        keys[blk, off], scales[blk, off] = k8, ks
    else:
        keys[rows], scales[rows] = k8, ks


def index_cache_of(k: torch.Tensor) -> torch.Tensor:
    """A ragged FP8 indexer cache uint8 [S, D_I + 4] holding keys [S, D_I] (quantized)."""
    k8, ks = quantize_index_keys(k)
    return torch.cat([k8.reshape(-1).view(torch.uint8), ks.view(torch.uint8)]).view(k.shape[0], -1)

"""The plugin's FP8 KV cache (`--kv-cache-dtype fp8_ds_mla`): vLLM's FP8 formats of GLM-5's two caches,
written and read by the GLM-5 backend's FP8 ops (SPEC 7.5-7.7).

- Latent cache: FlashMLA V3.2's 656-byte row per token (512 e4m3 | 4 fp32 tile scales | 64 bf16 RoPE), the
  `fp8_ds_mla` format of vLLM's own GLM-5. A row is quantized once, when it is written, by the backend's
  `fp8_mla_cache_quant`, and attention reads the rows with `fp8_sparse_mla_attention`. The row is defined
  for GLM-5's widths only (kv_lora_rank 512, qk_rope_head_dim 64).
- Indexer cache, where the backend declares `fp8_indexer_topk`: D_I e4m3 bytes and one fp32 UE8M0 scale
  per key (132 bytes for D_I = 128), in vLLM's DeepSeek-V3.2 block layout: a block holds its block_size
  keys' e4m3 values first, then their block_size scales. The indexer reads both through views (no copy);
  the query is quantized per call, as keys and queries are in the project's own FP8 path.

The numerics are those of `quant.fp8.FP8Attention` (the project's FP8-cache decode): both quantize
per row (per key), so quantizing at write time gives the values it gets by quantizing the whole cache at
each call.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.formats import E4M3, MLA_ROW_BYTES, quantize_indexer_inputs
from glm5.core.config import GLM5Config
from glm5.vllm.cache import PagedCaches

#: vLLM's name of the FP8 cache; the plugin's flag is the same: `--kv-cache-dtype fp8_ds_mla`
FP8_DS_MLA = "fp8_ds_mla"
FLOAT_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCALE_BYTES = 4  # one fp32 scale per indexer key
MLA_WIDTHS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) of the 656-byte row
LATENT_OPS = ("fp8_mla_cache_quant", "fp8_sparse_mla_attention")
INDEXER_OP = "fp8_indexer_topk"


def width_reason(cfg: Any) -> str | None:
    """Why a model cannot keep its latent cache in 656-byte rows (None: it can). `cfg` is a GLM5Config or
    vLLM's hf_config (the same field names)."""
    got = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if got != MLA_WIDTHS:
        return (
            f"the 656-byte FP8 row holds kv_lora_rank 512 + qk_rope_head_dim 64 (GLM-5's widths), "
            f"this model has {got[0]} + {got[1]}"
        )
    return None


def check_cache_dtype(cache_dtype: str, cfg: Any) -> None:
    """Refuse, in one line naming `kv_cache_dtype`, a cache dtype the plugin cannot store."""
    if cache_dtype in FLOAT_CACHE_DTYPES:
        return
    if cache_dtype != FP8_DS_MLA:
        raise ValueError(
            f"kv_cache_dtype: Glm5BackendsForCausalLM stores 'auto' (the model dtype) or {FP8_DS_MLA!r} "
            f"(FlashMLA's 656-byte FP8 rows), got {cache_dtype!r}"
        )
    why = width_reason(cfg)
    if why:
        raise ValueError(f"kv_cache_dtype: {FP8_DS_MLA!r} needs GLM-5's MLA widths: {why}")


class CacheFormats:
    """What each of a layer's two caches stores per token: (width, dtype) of the latent cache and of the
    indexer cache, for the cache dtype vLLM was given and what the backend declares."""

    def __init__(self, cfg: GLM5Config, cache_dtype: str, backend: Any, model_dtype: torch.dtype) -> None:
        check_cache_dtype(cache_dtype, cfg)
        self.fp8_latent = cache_dtype == FP8_DS_MLA
        missing = [op for op in LATENT_OPS if not backend.capabilities(op)]
        if self.fp8_latent and missing:
            raise ValueError(
                f"kv_cache_dtype: {FP8_DS_MLA!r} needs the backend's {' and '.join(missing)}; "
                f"backend {backend.name!r} does not declare it (see `glm5 doctor`)"
            )
        self.fp8_indexer = self.fp8_latent and bool(backend.capabilities(INDEXER_OP))
        latent_w, index_w = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_head_dim
        self.latent = (MLA_ROW_BYTES, torch.uint8) if self.fp8_latent else (latent_w, model_dtype)
        self.index = (index_w + SCALE_BYTES, torch.uint8) if self.fp8_indexer else (index_w, model_dtype)
        self.index_head_dim = index_w


def index_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [nb, bs, D_I + 4] in vLLM's block layout -> views (keys e4m3 [nb, bs, D_I], scales fp32
    [nb, bs]) into the same memory."""
    nb, bs, _ = cache.shape
    flat = cache.view(nb, -1)
    keys = flat[:, : bs * head_dim].view(nb, bs, head_dim).view(E4M3)
    scales = flat[:, bs * head_dim :].view(torch.float32)
    return keys, scales


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys [T, D_I] -> (e4m3 [T, D_I], fp32 UE8M0 scales [T]): the key half of the contract's
    `quantize_indexer_inputs` (no queries here)."""
    _, k8, ks, _ = quantize_indexer_inputs(k.new_empty(0, 1, k.shape[1]), k, k.new_empty(0, 1))
    return k8, ks


def quantize_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries [T, H_I, D_I] and head weights [T, H_I] -> (q e4m3, weights * q scale fp32)."""
    q8, _, _, w8 = quantize_indexer_inputs(q, q.new_empty(0, q.shape[2]), weights)
    return q8, w8


def write_latent(backend: Any, cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize latent rows [T, 576] with the backend's fp8_mla_cache_quant into uint8 cache rows `rows`."""
    cache.view(-1, MLA_ROW_BYTES).index_copy_(0, rows, backend.fp8_mla_cache_quant(values))


def write_index(cache: torch.Tensor, head_dim: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize indexer keys [T, D_I] into slots `rows` of the block-layout FP8 indexer cache."""
    bs = cache.shape[1]
    keys, scales = index_views(cache, head_dim)
    k8, ks = quantize_keys(values)
    blk, off = rows // bs, rows % bs
    keys[blk, off] = k8
    scales[blk, off] = ks


class FP8CacheOps:
    """The step's backend when a cache is FP8: `indexer_topk` and `sparse_mla_attention` read the uint8
    caches with the FP8 ops; everything else (and every call count) is the backend's own."""

    def __init__(self, backend: Any, index_head_dim: int) -> None:
        self._backend, self._head_dim = backend, index_head_dim

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def indexer_topk(self, q, k_cache, weights, layout, topk):
        if k_cache.dtype != torch.uint8:
            return self._backend.indexer_topk(q, k_cache, weights, layout, topk)
        keys, scales = index_views(k_cache, self._head_dim)
        q8, w8 = quantize_queries(q, weights)
        return self._backend.fp8_indexer_topk(q8, keys, scales, w8, layout, topk)

    def sparse_mla_attention(self, q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True):
        if kv_cache.dtype != torch.uint8:
            return self._backend.sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse)
        return self._backend.fp8_sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse)


class FP8PagedCaches(PagedCaches):
    """PagedCaches whose uint8 caches are written through the FP8 quantizers (the float ones as before)."""

    def __init__(self, latent, index_k, backend: Any, index_head_dim: int) -> None:
        super().__init__(latent, index_k, backend.mla_cache)
        self.backend, self.index_head_dim = backend, index_head_dim

    def write(self, which: str, layer: int, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        cache = self.layers[which][layer].kv_cache
        if cache.dtype != torch.uint8:
            return super().write(which, layer, rows, values)
        if which == "kv":
            write_latent(self.backend, cache, rows, values)
        else:
            write_index(cache, self.index_head_dim, rows, values)
        return cache

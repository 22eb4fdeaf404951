"""The plugin's FP8 KV cache (`--kv-cache-dtype fp8_ds_mla`): vLLM's FP8 formats of GLM-5's two caches,
written by the backend's fp8_mla_cache_quant and the contract's key quantizer, read by the backend's
`sparse_mla_attention` / `indexer_topk`, whose cache kind picks their FP8 kernels (SPEC 7.8).

- Latent cache: FlashMLA V3.2's 656-byte row per token (512 e4m3 | 4 fp32 tile scales | 64 bf16 RoPE), the
  `fp8_ds_mla` format of vLLM's own GLM-5, quantized once, when it is written. The row is defined for
  GLM-5's widths only (kv_lora_rank 512, qk_rope_head_dim 64).
- Indexer cache, where the backend's indexer_topk serves the FP8 kinds: D_I e4m3 bytes and one fp32 UE8M0
  scale per key (132 bytes for D_I = 128), in vLLM's DeepSeek-V3.2 block layout
  (`backends.formats.index_cache_views`); the backend quantizes the query per call.

The numerics are the project's own FP8-cache decode (`glm5.core.cache.CacheFormat("fp8_ds_mla")`, what
`quant.fp8.fp8_policy` runs): the same writes, the same ops.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.cache_layout import FP8_KINDS
from backends.formats import INDEX_SCALE_BYTES, MLA_ROW_BYTES, write_index_cache
from glm5.core.cache import FP8_DS_MLA, MLA_WIDTHS
from glm5.core.config import GLM5Config
from glm5.vllm.cache import PagedCaches

FLOAT_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def serves_fp8(backend: Any, op: str) -> bool:
    """Whether the backend's `op` reads a cache of FP8 rows (its caps list the FP8 kinds)."""
    caps = backend.capabilities(op)
    return caps is not None and set(FP8_KINDS) <= set(caps.layouts)


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
        missing = [
            need
            for need, ok in (
                ("fp8_mla_cache_quant", backend.capabilities("fp8_mla_cache_quant") is not None),
                (
                    f"sparse_mla_attention on {' / '.join(FP8_KINDS)}",
                    serves_fp8(backend, "sparse_mla_attention"),
                ),
            )
            if not ok
        ]
        if self.fp8_latent and missing:
            raise ValueError(
                f"kv_cache_dtype: {FP8_DS_MLA!r} needs the backend's {' and '.join(missing)}; "
                f"backend {backend.name!r} does not declare it (see `glm5 doctor`)"
            )
        self.fp8_indexer = self.fp8_latent and serves_fp8(backend, "indexer_topk")
        latent_w, index_w = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_head_dim
        self.latent = (MLA_ROW_BYTES, torch.uint8) if self.fp8_latent else (latent_w, model_dtype)
        self.index = (
            (index_w + INDEX_SCALE_BYTES, torch.uint8) if self.fp8_indexer else (index_w, model_dtype)
        )
        self.index_head_dim = index_w


def write_latent(backend: Any, cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize latent rows [T, 576] with the backend's fp8_mla_cache_quant into uint8 cache rows `rows`."""
    cache.view(-1, MLA_ROW_BYTES).index_copy_(0, rows, backend.fp8_mla_cache_quant(values))


class FP8PagedCaches(PagedCaches):
    """PagedCaches whose uint8 caches are written through the FP8 quantizers (the float ones as before)."""

    def __init__(self, latent, index_k, backend: Any) -> None:
        super().__init__(latent, index_k, backend.mla_cache)
        self.backend = backend

    def write(self, which: str, layer: int, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        cache = self.layers[which][layer].kv_cache
        if cache.dtype != torch.uint8:
            return super().write(which, layer, rows, values)
        if which == "kv":
            write_latent(self.backend, cache, rows, values)
        else:
            write_index_cache(cache, rows, values)
        return cache

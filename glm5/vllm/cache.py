"""GLM-5's two caches in vLLM's paged KV pool, and the one `SeqLayout` per step built from vLLM's metadata.

Each attention layer owns a cache-only `AttentionLayerBase` for its latent rows `[c_kv ; k_pe]`, and each
layer that runs the indexer ('full' in `indexer_types`) one more for its indexer keys (the pattern of
vLLM's `DeepseekV32IndexerCache`). They bring their own attention backend, `Glm5CacheBackend`, whose
metadata builder turns vLLM's `CommonAttentionMetadata` (query_start_loc, seq_lens, block table, slot
mapping) into a `SeqLayout`; so vLLM allocates, pages and schedules the caches while every computation
is the GLM-5 backend's. The CPU platform is never asked for a sparse attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SparseCacheRole
from vllm.v1.kv_cache_layout import KVCacheLayout

from backends import SeqLayout
from backends.cache_layout import ONE_TENSOR, MLACache, MLACacheLayout, write_rows


@dataclass
class Glm5StepMetadata(AttentionMetadata):
    """What every GLM-5 layer of one step shares: the layout (queries = the step's new tokens, keys =
    context + new tokens, paged through vLLM's block table) and the cache row of each new token."""

    layout: SeqLayout
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block * block_size + offset
    num_tokens: int


class Glm5StepMetadataBuilder(AttentionMetadataBuilder[Glm5StepMetadata]):
    # the backend ops read lengths on the host (SeqLayout.host): no CUDA graphs
    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None

    # The latent and the indexer caches have different widths, so vLLM gives them separate attention
    # groups (one builder each) over one KV cache group: the same CommonAttentionMetadata object. The
    # last one seen is kept so both builders hand out the same metadata, hence one SeqLayout per step.
    # The MTP drafter rebuilds from the same CommonAttentionMetadata object, changed in place, once per
    # draft token: the draft index is part of the key.
    _last: tuple[CommonAttentionMetadata, int, Glm5StepMetadata] | None = None

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> Glm5StepMetadata:
        return self._build(common_attn_metadata, -1)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int):
        return self._build(common_attn_metadata, draft_index)

    def _build(self, cm: CommonAttentionMetadata, draft_index: int) -> Glm5StepMetadata:
        last = Glm5StepMetadataBuilder._last
        if last is not None and last[0] is cm and last[1] == draft_index:
            return last[2]
        b, t = cm.num_reqs, cm.num_actual_tokens
        layout = SeqLayout(
            cm.query_start_loc[: b + 1].to(torch.int32),
            cm.seq_lens[:b].to(torch.int32),
            block_table=cm.block_table_tensor[:b].to(torch.int32),
            max_seqlen_k=cm.max_seq_len,  # vLLM's host int: no op reads the lengths back
            trusted=True,  # vLLM's scheduler built it: value checks only under GLM5_VALIDATE=values
        )
        meta = Glm5StepMetadata(layout, cm.slot_mapping[:t].to(torch.int64), t)
        Glm5StepMetadataBuilder._last = (cm, draft_index, meta)
        return meta


class Glm5CacheBackend(AttentionBackend):
    """Storage only: vLLM allocates and pages the cache; the model's layers read and write it."""

    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes = ["auto", "float32", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "GLM5_BACKENDS_CACHE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("GLM-5 cache layers compute nothing; the model calls the backend ops")

    @staticmethod
    def get_builder_cls() -> type[Glm5StepMetadataBuilder]:
        return Glm5StepMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # SeqLayout pages with any block size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # layer-compact: each layer's cache is one contiguous [num_blocks, block_size, D] tensor
        return (KVCacheLayout.LBHNC,)


class Glm5CacheLayer(nn.Module, AttentionLayerBase):
    """One paged cache of `width` values per token for one layer, registered under `prefix`. A latent
    cache is bound as `mla_cache` says (set by PagedCaches from the backend): vLLM's one buffer per layer,
    as one tensor or reinterpreted as the backend's split pools (same bytes per block: same page size)."""

    mla_cache: MLACacheLayout = ONE_TENSOR

    def __init__(
        self, prefix: str, width: int, dtype: torch.dtype, cache_config: CacheConfig, indexer: bool
    ) -> None:
        super().__init__()
        self.prefix, self.width, self.dtype, self.cache_config = prefix, width, dtype, cache_config
        self.role = SparseCacheRole.INDEXER if indexer else SparseCacheRole.SPARSE
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM's per-layer view is [num_blocks, H=1, block_size, D]; SeqLayout pages [nb, block_size, D]
        cache = kv_cache.squeeze(1)
        if cache.dim() == 3 and not cache.is_contiguous():
            raise ValueError(
                f"{self.prefix}: expected a contiguous [num_blocks, block_size, {self.width}] cache view, "
                f"got strides {cache.stride()} (KV cache layout must be layer-compact)"
            )
        self.kv_cache: MLACache = cache
        if self.role is SparseCacheRole.SPARSE and cache.dim() == 3:
            self.kv_cache = self.mla_cache.view(cache, cache.shape[1])

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return MLAAttentionSpec(  # one vector per token (no separate V)
            block_size=self.cache_config.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=self.width,
            dtype=self.dtype,
            cache_role=self.role,
        )

    def get_attn_backend(self) -> type[AttentionBackend]:
        return Glm5CacheBackend

    def forward(self) -> None:  # storage only
        raise RuntimeError(f"{self.prefix} is a cache, not a layer to call")


class PagedCaches:
    """What `glm5.core.attention.MLAAttention` asks of a cache (`write`), over the tensors vLLM bound to the
    cache layers: latent[i] for attention layer i, index_k[i] (None for a shared layer); the latent
    layers are bound as the backend's `mla_cache` declares (one tensor or split pools)."""

    def __init__(
        self,
        latent: list[Glm5CacheLayer],
        index_k: list[Glm5CacheLayer | None],
        mla_cache: MLACacheLayout = ONE_TENSOR,
    ) -> None:
        self.layers = {"kv": latent, "index_k": index_k}
        for layer in latent:
            layer.mla_cache = mla_cache

    def write(self, which: str, layer: int, rows: torch.Tensor, values: torch.Tensor) -> MLACache:
        """Write values [T, D] at cache rows `rows` (vLLM's slot mapping) of cache `which` of `layer`."""
        cache = self.layers[which][layer].kv_cache
        write_rows(cache, rows, values)
        return cache

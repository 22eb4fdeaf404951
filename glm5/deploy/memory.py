"""Per-device memory that is not weights: the latent KV cache, the indexer key cache, and the workspace.

Cache bytes per token and layer (the cache layouts of FlashMLA and vllm-ascend):
  latent KV  bf16: (kv_lora_rank + qk_rope_head_dim) x 2 = 1152      (576-d row [c_kv ; k_pe])
             fp8:  kv_lora_rank + 4 x kv_lora_rank / 128 + 2 x qk_rope_head_dim = 656
                   (FlashMLA fp8_ds_mla: 512 fp8 + 4 fp32 tile scales + 64 bf16 rope; vllm-ascend's int8 C8
                   cache has the same size)
  indexer K  bf16: index_head_dim x 2 = 256;  fp8: index_head_dim + 4 x index_head_dim / 128 = 132
Every main layer holds a latent row; only layers with their own indexer ('full' in indexer_types, and every
MTP layer) hold an indexer key. MLA has one latent "head", so tensor parallelism does not split the cache:
each rank of a data-parallel replica holds the whole cache of that replica's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5.core.config import GLM5Config

_SCALE_TILE = 128  # fp8 tiles of 128 values, one fp32 scale each


def latent_bytes(c: GLM5Config, fmt: str) -> int:
    if fmt == "bf16":
        return (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    if fmt == "fp8":
        return c.kv_lora_rank + 4 * -(-c.kv_lora_rank // _SCALE_TILE) + 2 * c.qk_rope_head_dim
    raise ValueError(f"kv_cache: expected 'bf16' or 'fp8', got {fmt!r}")


def indexer_bytes(c: GLM5Config, fmt: str) -> int:
    if fmt == "bf16":
        return c.index_head_dim * 2
    if fmt == "fp8":
        return c.index_head_dim + 4 * -(-c.index_head_dim // _SCALE_TILE)
    raise ValueError(f"indexer_cache: expected 'bf16' or 'fp8', got {fmt!r}")


@dataclass(frozen=True)
class CacheBytes:
    """Bytes per token over all cached layers (main + MTP when served)."""

    kv: int
    indexer: int
    layers: int
    indexer_layers: int

    @property
    def total(self) -> int:
        return self.kv + self.indexer


def cache_bytes_per_token(c: GLM5Config, kv_fmt: str, idx_fmt: str, mtp: bool) -> CacheBytes:
    has_idx = [t == "full" for t in c.indexer_types] + [True] * (c.num_nextn_predict_layers if mtp else 0)
    n_idx = sum(has_idx)
    return CacheBytes(
        len(has_idx) * latent_bytes(c, kv_fmt), n_idx * indexer_bytes(c, idx_fmt), len(has_idx), n_idx
    )


def tokens_per_sequence(max_model_len: int, spec_tokens: int, block_size: int) -> int:
    """Cache slots of one full-length sequence: its tokens plus the speculative lookahead, in whole blocks."""
    n = max_model_len + spec_tokens
    return -(-n // block_size) * block_size


def workspace(
    c: GLM5Config,
    tp: int,
    moe_ranks: int,
    expert_parallel: bool,
    batched_tokens: int,
    max_num_seqs: int,
    spec_tokens: int,
    comm_groups: int,
    comm_buffer: int,
    reserve: int,
) -> dict[str, int]:
    """Peak bytes one rank needs besides weights and caches, by component.

    activations: one layer at a time (layers run in sequence, buffers are reused) at `batched_tokens` tokens
      of this replica: the residual stream and normed input (2 x T x D bf16) plus the larger of
      attention (q_b output, absorbed query [T, H/tp, c + r], latent output [T, H/tp, c], V-up output, the
      indexer query [T, H_I, D_I] and its int32 top-k [T, index_topk]) and MoE (rows = T x min(top_k, local
      experts), the worst case of every chosen expert on this rank: int8 input, bf16 gate|up output, SwiGLU
      output and its int8 requantization, bf16 down output).
    logits: fp32 logits over the full vocabulary for every sequence's 1 + spec_tokens positions.
    comm_buffers: the collective library's buffer per communication group (HCCL_BUFFSIZE on Ascend).
    reserve: the profile's runtime reserve (driver context, graph pools, allocator slack).
    """
    t, d, h = batched_tokens, c.hidden_size, c.num_attention_heads // tp
    lat = c.kv_lora_rank + c.qk_rope_head_dim
    attn = 2 * t * h * (c.qk_head_dim + lat + c.kv_lora_rank + c.v_head_dim)
    attn += 2 * t * c.index_n_heads * c.index_head_dim + 4 * t * c.index_topk
    local = c.n_routed_experts // moe_ranks if expert_parallel else c.n_routed_experts
    inter = c.moe_intermediate_size if expert_parallel else c.moe_intermediate_size // moe_ranks
    rows = t * min(c.num_experts_per_tok, local)
    moe = rows * (d + 2 * 2 * inter + 2 * inter + inter + 2 * d)
    return {
        "activations": 2 * 2 * t * d + max(attn, moe),
        "logits": 4 * max_num_seqs * (1 + spec_tokens) * c.vocab_size,
        "comm_buffers": comm_groups * comm_buffer,
        "reserve": reserve,
    }

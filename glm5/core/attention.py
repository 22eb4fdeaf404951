"""MLA attention in the absorbed form with DeepSeek Sparse Attention (SPEC 2.2, 2.4, 5).

Per token, MLA stores one latent row `[c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)]` (576 wide for
GLM-5) shared by every head. Queries are absorbed into that space: `q_nope` is multiplied by W_UK
(the key half of `kv_b_proj`), so one `sparse_mla_attention` call over the latent rows computes
attention for all heads; its 512-wide output goes through W_UV (the value half) to `v_head_dim`.
The lightning indexer picks, per query, the `index_topk` keys attention may read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends import Backend
from glm5.core.cache import AUTO, CacheFormat, KVCache, StepSlots
from glm5.core.config import GLM5Config
from glm5.core.layers import RMSNorm, apply_rope


@dataclass
class Step:
    """What every layer of one forward step shares."""

    backend: Backend
    slots: StepSlots  # layout, positions, cache rows of the new tokens
    cos: torch.Tensor  # [T, r/2] fp32 RoPE angles of the new tokens
    sin: torch.Tensor
    cache: KVCache | None  # None: the new tokens are the whole context (training, plain forward)
    cache_format: CacheFormat = AUTO  # what a row of the caches holds (model values, or FP8 rows)

    def store(self, which: str, layer: int, values: torch.Tensor) -> torch.Tensor:
        """This step's rows [T, D] of cache `which` ('kv' or 'index_k') as the layer reads them: written
        into the cache (returned whole), or, with no cache, the rows themselves in the cache format."""
        if self.cache is None:
            return self.cache_format.rows(which, values, self.backend)
        return self.cache.write(which, layer, self.slots.rows, values)


class Indexer(nn.Module):
    """Lightning indexer: scores every causal key with sum_h w[t,h] * relu(q_I[t,h] . k_I[s]) and returns
    the top `index_topk` positions through the backend's `indexer_topk`."""

    def __init__(self, cfg: GLM5Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = (
            cfg.index_n_heads,
            cfg.index_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.topk, self.interleaved = cfg.index_topk, cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        # fp32 parameter, fp32 input: bf16 head weights round into extra score ties (SGLang #23856)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=torch.float32)

    def _rope(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        # GLM-5 rotates the FIRST rope_dim dims of the indexer vectors (MLA rotates its last ones)
        pe, nope = x[..., : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([apply_rope(pe, step.cos, step.sin, self.interleaved), nope], dim=-1)

    def keys(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D] -> indexer keys [T, D_I] (LayerNorm with bias in fp32, then RoPE)."""
        k = nn.functional.layer_norm(
            self.wk(x).float(),
            (self.head_dim,),
            self.k_norm.weight.float(),
            self.k_norm.bias.float(),
            self.k_norm.eps,
        ).to(x.dtype)
        return self._rope(k, step)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, k_cache: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D], qr [T, q_lora_rank], k_cache holding this step's keys -> int32 [T, index_topk]."""
        t = x.shape[0]
        q = self._rope(self.wq_b(qr).view(t, self.n_heads, self.head_dim), step)  # [T, H_I, D_I]
        w = self.weights_proj(x.float()) * (self.n_heads**-0.5 * self.head_dim**-0.5)  # [T, H_I] fp32
        return step.backend.indexer_topk(q, k_cache, w, step.slots.layout, self.topk)


class MLAAttention(nn.Module):
    """Multi-head latent attention over a sparse (DSA) key set. A layer without an indexer
    ('shared' in `indexer_types`) attends to the keys the previous full layer selected."""

    def __init__(
        self, cfg: GLM5Config, layer_idx: int, has_indexer: bool, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError(
                "q_lora_rank: expected an int (the DSA indexer reads the low-rank query), got None"
            )
        self.layer_idx = layer_idx
        self.n_heads, self.nope, self.rope = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.v_dim, self.c = cfg.v_head_dim, cfg.kv_lora_rank
        self.sm_scale, self.interleaved = cfg.sm_scale, cfg.rope_interleave
        h, d, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.lora_eps, dtype)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.c + self.rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.c, cfg.lora_eps, dtype)
        self.kv_b_proj = nn.Linear(self.c, h * (self.nope + self.v_dim), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias, dtype=dtype)
        self.indexer = Indexer(cfg, dtype) if has_indexer else None
        # where the latent rows leave the per-token projections for the per-head attention: a named point
        # a parallel plan hooks (glm5/parallel/plan.py); the head count is read from the weights below, so
        # a plan that keeps whole heads per rank needs nothing else from this file
        self.latent = nn.Identity()

    def project(self, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q [T, H, c + r] absorbed, latent rows [T, c + r], qr [T, q_lora_rank])."""
        t = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(t, -1, self.nope + self.rope)
        q_nope, q_pe = (
            q[..., : self.nope],
            apply_rope(q[..., self.nope :], step.cos, step.sin, self.interleaved),
        )
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.c])
        k_pe = apply_rope(kv[:, self.c :], step.cos, step.sin, self.interleaved)
        w_uk = self.kv_b_proj.weight.view(-1, self.nope + self.v_dim, self.c)[:, : self.nope]  # [H, n, c]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        return torch.cat([q_lat, q_pe], dim=-1), self.latent(torch.cat([c_kv, k_pe], dim=-1)), qr

    def forward(
        self, x: torch.Tensor, step: Step, shared_topk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (normed) -> (out [T, D], the int32 [T, index_topk] key positions used)."""
        q, rows, qr = self.project(x, step)
        layer = self.layer_idx
        kv_cache = step.store("kv", layer, rows)  # its kind (float or FP8 rows) picks the backend's kernel
        if self.indexer is not None:
            # detached: the LM loss never trains the indexer (its own KL loss does)
            k_cache = step.store("index_k", layer, self.indexer.keys(x.detach(), step))
            topk = self.indexer(x.detach(), qr.detach(), k_cache, step)
        elif shared_topk is None:
            raise ValueError(
                f"shared_topk: layer {layer} has no indexer and needs the previous full layer's top-k"
            )
        else:
            topk = shared_topk
        # the model never uses lse (training differentiates `out` only): let the backend skip it
        out, _ = step.backend.sparse_mla_attention(
            q, kv_cache, topk, step.slots.layout, self.sm_scale, self.c, return_lse=False
        )
        w_uv = self.kv_b_proj.weight.view(-1, self.nope + self.v_dim, self.c)[:, self.nope :]  # [H, v, c]
        o = torch.einsum("thc,hvc->thv", out, w_uv)
        return self.o_proj(o.reshape(x.shape[0], -1)), topk

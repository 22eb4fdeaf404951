"""Independent float64 oracles for the GLM-5 attention layer: MLA in its non-absorbed (per-head K/V)
form with an explicit mask, and the indexer scores, written from the formulas (SPEC 2.1, 2.4, 5)
without the model's helpers."""

from __future__ import annotations

import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM


def make_model(seed: int = 0, **overrides) -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny", **overrides), backend="reference")
    model.init_weights(seed)
    return model.eval()


def random_ids(b: int, s: int, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def rope64(x: torch.Tensor, pos: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """Complex-multiplication RoPE; x [T, ..., r] float64."""
    r = x.shape[-1]
    ang = pos.double()[:, None] / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)  # [T, r/2]
    rot = torch.polar(torch.ones_like(ang), ang).reshape(ang.shape[0], *([1] * (x.dim() - 2)), r // 2)
    if interleaved:
        y = torch.view_as_complex(x.reshape(*x.shape[:-1], r // 2, 2).contiguous()) * rot
        return torch.view_as_real(y).flatten(-2)
    y = torch.complex(x[..., : r // 2], x[..., r // 2 :]) * rot
    return torch.cat([y.real, y.imag], dim=-1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _d(w)


def mla_dense(
    attn, cfg: GLM5Config, x: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Per-head MLA attention of x [T, D] over the same T tokens where allowed [T, T] -> [T, D] float64."""
    t, h, n, r, v, c = (
        x.shape[0],
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    x = _d(x)
    qr = _rms(x @ _d(attn.q_a_proj.weight).T, attn.q_a_layernorm.weight, cfg.rms_norm_eps)
    q = (qr @ _d(attn.q_b_proj.weight).T).view(t, h, n + r)
    q_pe = rope64(q[..., n:], pos, cfg.rope_theta, cfg.rope_interleave)
    kv = x @ _d(attn.kv_a_proj_with_mqa.weight).T
    c_kv = _rms(kv[:, :c], attn.kv_a_layernorm.weight, cfg.rms_norm_eps)
    k_pe = rope64(kv[:, c:], pos, cfg.rope_theta, cfg.rope_interleave)
    kvb = (c_kv @ _d(attn.kv_b_proj.weight).T).view(t, h, n + v)
    scores = torch.einsum("thd,shd->hts", q[..., :n], kvb[..., :n]) + torch.einsum("thd,sd->hts", q_pe, k_pe)
    scores = (scores * (n + r) ** -0.5).masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1))
    o = torch.einsum("hts,shv->thv", p, kvb[..., n:]).reshape(t, h * v)
    return o @ _d(attn.o_proj.weight).T


def indexer_scores(attn, cfg: GLM5Config, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """sum_h w[t,h] H_I^-1/2 D_I^-1/2 relu(q_I[t,h] . k_I[s]) for causal s, else -inf: [T, T] float64."""
    ix, t = attn.indexer, x.shape[0]
    hi, di, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    x = _d(x)
    qr = _rms(x @ _d(attn.q_a_proj.weight).T, attn.q_a_layernorm.weight, cfg.rms_norm_eps)
    q = (qr @ _d(ix.wq_b.weight).T).view(t, hi, di)
    q = torch.cat([rope64(q[..., :r], pos, cfg.rope_theta, cfg.indexer_rope_interleave), q[..., r:]], -1)
    k = torch.nn.functional.layer_norm(
        x @ _d(ix.wk.weight).T, (di,), _d(ix.k_norm.weight), _d(ix.k_norm.bias), 1e-6
    )
    k = torch.cat([rope64(k[:, :r], pos, cfg.rope_theta, cfg.indexer_rope_interleave), k[:, r:]], -1)
    w = x @ _d(ix.weights_proj.weight).T * hi**-0.5 * di**-0.5
    s = torch.einsum("ths,th->ts", torch.relu(torch.einsum("thd,sd->ths", q, k)), w)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return s.masked_fill(~causal, float("-inf"))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, S] bool: the k best causal keys per row (value desc, lower index first among ties)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)
    return mask & torch.isfinite(scores)

"""GLM-5 (`glm_moe_dsa`): MLA + DSA attention, MoE, MTP, on the backend interface (SPEC 5).

Tokens of all requests are concatenated along one axis (T, the TND layout of SPEC 1); `input_ids
[B, S]` are flattened on entry and logits reshaped on exit. Every hot op goes through `self.backend`;
nothing here branches on the device. Quantization and parallelism are applied from outside
(they replace modules or parameters; see docs/model.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import backends
from backends import Backend, SeqLayout
from glm5.core.attention import MLAAttention, Step
from glm5.core.cache import CacheFormat, KVCache, StepSlots
from glm5.core.config import GLM5Config
from glm5.core.layers import MLP, RMSNorm, rope_angles
from glm5.core.moe import MoE


@dataclass
class GLM5Output:
    logits: torch.Tensor | None  # [B, S, V]
    hidden_states: torch.Tensor  # [B, S, D]: after the final norm (main) / before it (MTP)
    loss: torch.Tensor | None = None
    topk: list[torch.Tensor] | None = None  # per layer int32 [B*S, index_topk] key positions used


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GLM5Config, idx: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        is_mtp = idx >= cfg.num_hidden_layers
        has_indexer = is_mtp or cfg.indexer_types[idx] == "full"  # MTP layers always run their own indexer
        cache_index = idx - cfg.num_hidden_layers if is_mtp else idx
        self.self_attn = MLAAttention(cfg, cache_index, has_indexer, dtype)
        self.is_moe = cfg.is_moe_layer(idx)
        self.mlp = MoE(cfg, dtype) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, step: Step, shared_topk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a, topk = self.self_attn(self.input_layernorm(x), step, shared_topk)
        x = x + a
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h, step), topk


class LMHead(nn.Linear):
    """The output projection [V, D]. `loss` is the chunked projection + cross-entropy of SPEC 2.9 through
    the backend, so a parallel plan that splits the vocabulary replaces both together (glm5/parallel)."""

    def loss(self, h: torch.Tensor, targets: torch.Tensor, step: Step) -> torch.Tensor:
        """h [N, D], targets [N] -> mean next-token loss (ignore_index -100), on the step's backend."""
        return step.backend.linear_cross_entropy(h, self.weight, targets)


def logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi over the vocabulary at `temperature`, fp32 [..., V]: the one log-softmax of the output logits
    that the trainer (glm5/train/rl/rollout.py) and, in the layout-invariant mode, the vLLM plugin's head
    (glm5/vllm/model.py) both take, so both sides give SPEC 12's bits."""
    return torch.log_softmax(logits.float() / temperature, -1)


class SharedHead(nn.Module):
    """The MTP layer's own final norm; the projection is the model's lm_head (shared)."""

    def __init__(self, cfg: GLM5Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MTPLayer(DecoderLayer):
    """Multi-token prediction: slot i combines the embedding of token i+1 with the main model's
    hidden state at i and predicts token i+2. Embedding and output head are the main model's."""

    def __init__(self, cfg: GLM5Config, idx: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, idx, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False, dtype=dtype)
        self.shared_head = SharedHead(cfg, dtype)

    def predict(self, emb: torch.Tensor, hidden: torch.Tensor, step: Step) -> torch.Tensor:
        """emb [T, D] (token i+1), hidden [T, D] (position i) -> hidden [T, D] before shared_head.norm."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        return super().forward(x, step, None)[0]


class GLM5Model(nn.Module):
    def __init__(self, cfg: GLM5Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, dtype) for i in range(n)]
            + [MTPLayer(cfg, n + j, dtype) for j in range(cfg.num_nextn_predict_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.num_main = n

    def forward(self, ids: torch.Tensor, step: Step) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [T] -> (normed hidden [T, D], per-layer top-k)."""
        x = self.embed_tokens(ids)
        topk: torch.Tensor | None = None
        used = []
        for layer in self.layers[: self.num_main]:
            x, topk = layer(x, step, topk)  # a shared layer receives the previous full layer's top-k
            used.append(topk)
        return self.norm(x), used


class GLM5ForCausalLM(nn.Module):
    def __init__(
        self, config: GLM5Config, backend: Backend | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self._backend = backend if isinstance(backend, Backend) else backends.get(backend)
        #: what the caches hold (`glm5.core.cache.CacheFormat`): "auto" (the model dtype) or "fp8_ds_mla"
        self.kv_cache_dtype = "auto"
        self.model = GLM5Model(config, dtype)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.device.type != "meta":  # on meta: shapes only (counts, or a load to follow)
            self.init_weights()
            self.to(self.backend.device)

    # -- the backend ---------------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The one backend every layer computes with (attention through `Step`, quantized layers through
        their own reference, set here)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Backend | str) -> None:
        self._backend = backend if isinstance(backend, Backend) else backends.get(backend)
        self.prepare_weights()

    def prepare_weights(self) -> None:
        """Give every layer that holds backend-laid-out weights (quantized linears and experts) the model's
        backend and let it lay its weights out once (`Backend.prepare`). Call after loading weights."""
        for module in self.modules():
            if module is not self and hasattr(module, "use_backend"):
                module.use_backend(self._backend)

    # -- construction -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Random init (normal(0, initializer_range) matrices, unit norms, small router bias)."""
        g = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("e_score_correction_bias"):
                val = torch.randn(p.shape, generator=g) * 0.1  # nonzero: choice must differ from weights
            elif name.endswith("norm.bias"):
                val = torch.zeros(p.shape)
            elif p.dim() == 1:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                val = torch.randn(p.shape, generator=g) * std
            p.copy_(val.to(p.dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        backend: Backend | str | None = None,
        dtype: torch.dtype | None = None,
        strict: bool = True,
    ) -> GLM5ForCausalLM:
        """Load a float Hugging Face `glm_moe_dsa` directory (config.json + safetensors, sharded or not).
        A quantized export is refused in one line: `glm5.loader.load_model` reads both."""
        from glm5.core.checkpoint import NotACheckpoint, load_pretrained
        from glm5.core.marks import quantized_mark

        mark = quantized_mark(path)
        if mark is not None:
            raise NotACheckpoint(
                f"path: {path} is a quantized checkpoint ({mark}); load it with glm5.loader.load_model"
            )
        return load_pretrained(cls, path, backend, dtype, strict)

    def save_pretrained(self, path: str | Path, max_shard_size: int = 5 << 30) -> None:
        """Write config.json + safetensors with the published names (sharded above max_shard_size bytes)."""
        from glm5.core.checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_size)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        mtp: bool = False,
        block_size: int | None = None,
        block_order: list[int] | None = None,
    ) -> KVCache:
        """A KV + indexer-key cache for the main layers (or, with mtp=True, for the MTP layers)."""
        c = self.config
        layers = self.model.layers[c.num_hidden_layers :] if mtp else self.model.layers[: c.num_hidden_layers]
        return KVCache(
            [layer.self_attn.indexer is not None for layer in layers],
            batch_size,
            max_len,
            c.kv_lora_rank + c.qk_rope_head_dim,
            c.index_head_dim,
            block_size=block_size,
            block_order=block_order,
            dtype=self.dtype,
            device=self.backend.device,
            mla_cache=self.backend.mla_cache,
            cache_format=self.cache_format,
            backend=self.backend,
        )

    @property
    def cache_format(self) -> CacheFormat:
        return CacheFormat(self.kv_cache_dtype, self.config.kv_lora_rank)

    # -- forward ------------------------------------------------------------------------------------
    def begin_step(self, q_lens: list[int], cache: KVCache | None) -> Step:
        dev = self.model.embed_tokens.weight.device
        if cache is None:
            layout = SeqLayout.from_lengths(q_lens, q_lens, device=dev)
            layout.trusted = True  # built from the lengths themselves
            positions = torch.cat([torch.arange(q, device=dev) for q in q_lens])
            slots = StepSlots(layout, positions, positions)
        else:
            slots = cache.begin(q_lens)
        cos, sin = rope_angles(slots.positions, self.config.qk_rope_head_dim, self.config.rope_theta)
        return Step(self.backend, slots, cos, sin, cache, self.cache_format)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
        *,
        return_topk: bool = False,
        return_logits: bool = True,
    ) -> GLM5Output:
        """input_ids [B, S] int -> logits [B, S, V]. With a cache, the S tokens of every request follow its
        cached context (prefill, chunked prefill, decode, speculative verify) and are appended to it.
        labels [B, S] (optional): next-token loss (labels shifted inside) via `linear_cross_entropy`."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, S], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        hidden, used, step = self._run(input_ids.reshape(-1), [s] * b, cache)
        hidden = hidden.view(b, s, -1)
        loss = None
        if labels is not None:
            h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            loss = self.lm_head.loss(h, labels[:, 1:].reshape(-1), step)
        logits = self.lm_head(hidden) if return_logits else None
        return GLM5Output(logits, hidden, loss, used if return_topk else None)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        q_lens: list[int],
        cache: KVCache | None = None,
        *,
        return_topk: bool = False,
    ) -> GLM5Output:
        """A ragged batch (SPEC 1): input_ids [T] are the new tokens of every request concatenated, q_lens[b]
        of request b (0 allowed with a cache) -> logits [T, V], hidden_states [T, D]."""
        if input_ids.dim() != 1 or sum(q_lens) != input_ids.shape[0]:
            raise ValueError(
                f"input_ids: expected [T={sum(q_lens)}] (sum of q_lens), got {tuple(input_ids.shape)}"
            )
        hidden, used, _ = self._run(input_ids, list(q_lens), cache)
        return GLM5Output(self.lm_head(hidden), hidden, None, used if return_topk else None)

    def _run(self, ids: torch.Tensor, q_lens: list[int], cache: KVCache | None):
        step = self.begin_step(q_lens, cache)
        hidden, used = self.model(ids, step)
        if cache is not None:
            cache.commit(q_lens)  # only after every layer wrote its rows
        return hidden, used, step

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: KVCache | None = None, depth: int = 0
    ) -> GLM5Output:
        """MTP layer `depth`: input_ids [B, S] are the tokens one ahead of `hidden [B, S, D]` (main model
        output at the same positions) -> logits [B, S, V] for the token two ahead; hidden_states is the
        layer output (the `hidden` of a chained next draft)."""
        b, s = input_ids.shape
        layer = self.model.layers[self.config.num_hidden_layers + depth]
        step = self.begin_step([s] * b, cache)
        emb = self.model.embed_tokens(input_ids.reshape(-1))
        # the embedding at position 0 is zeroed, as vLLM's MTP layer does for the published weights
        emb = emb.masked_fill((step.slots.positions == 0)[:, None], 0.0)
        x = layer.predict(emb, hidden.reshape(b * s, -1), step)
        if cache is not None:
            cache.commit([s] * b)
        logits = self.lm_head(layer.shared_head.norm(x)).view(b, s, -1)
        return GLM5Output(logits, x.view(b, s, -1))

    # -- facts --------------------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """total, MTP and activated-per-token parameter counts (works on the meta device)."""
        c = self.config
        seen: set[int] = set()
        total = mtp = routed = 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            total += n
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= c.num_hidden_layers:
                mtp += n
            elif ".mlp.experts." in name:
                routed += n
        active_routed = routed * c.num_experts_per_tok // max(c.n_routed_experts, 1)
        return {
            "total": total,
            "mtp": mtp,
            "total_without_mtp": total - mtp,
            "routed_experts": routed,
            "activated_without_mtp": total - mtp - routed + active_routed,
        }

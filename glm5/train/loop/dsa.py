"""DSA training signals, taken from the model with forward hooks (the model files stay untouched):

- the indexer KL loss of DeepSeek-V3.2 / GLM-5. Teacher p_t: the layer's attention distribution summed
  over heads and L1-normalised, detached. Student: softmax of the indexer logits (`indexer_logits`,
  SPEC 2.1) computed from detached indexer inputs, so the indexer learns only from this loss.
  Stage 'warmup': p_t over every causal key (dense). Stage 'sparse': p_t and the student restricted to the
  keys the layer attended (its top-k).
- the largest attention logit `sm_scale * q . k` over the keys attention read (the quantity QK-clip
  style methods watch; a Muon Split vs whole-matrix comparison reports it);
- expert load per router, for aux-loss-free balancing: `e_score_correction_bias += gamma * sign(mean -
  load)` after each optimizer step (DeepSeek-V3 section 2.1.2).

The hook recomputes the attention projections (`MLAAttention.project`) under no_grad, since the model
does not return them; a model-side hook returning (q, latent rows, qr) would save that work.
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.core.attention import MLAAttention, Step
from glm5.core.moe import Router
from glm5.parallel.group import Group, Single
from glm5.train.loop.activations import recomputing

STAGES = ("warmup", "sparse")


def kl_rows(p: torch.Tensor, logq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum_j p log(p / q) per row over `valid` entries. p, logq, valid [R, K] -> [R] fp32."""
    term = torch.where(valid & (p > 0), p * (torch.log(p.clamp_min(1e-30)) - logq), 0.0)
    return term.sum(-1)


class AttentionProbe:
    """Forward hooks on every `MLAAttention` of `model`. While active, each attention call appends its
    indexer KL term (layers with an indexer, when `stage` is set) and its largest attention logit."""

    def __init__(self, model: nn.Module, stage: str | None = None, track_max_logit: bool = True) -> None:
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage: expected one of {STAGES} or None, got {stage!r}")
        self.stage, self.track_max_logit = stage, track_max_logit
        self.kl_terms: list[torch.Tensor] = []
        self.max_logits: list[float] = []
        self.active = True
        self._handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, MLAAttention)
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def reset(self) -> None:
        self.kl_terms, self.max_logits = [], []

    def kl_loss(self) -> torch.Tensor | None:
        """Mean of the per-layer KL terms collected since the last reset (None if there are none)."""
        return torch.stack(self.kl_terms).mean() if self.kl_terms else None

    def _hook(self, mod: MLAAttention, args: tuple, output: tuple) -> None:
        if not self.active or (self.stage is None and not self.track_max_logit):
            return
        x, step = args[0], args[1]
        if step.cache is not None:  # inference; training runs without a cache
            return
        topk = output[1]
        with torch.no_grad():
            q, rows, qr = mod.project(x.detach(), step)  # q [T, H, c+r], rows [T, c+r]
        if self.track_max_logit and not recomputing():
            self.max_logits.append(float(_selected_logits(q, rows, topk, step, mod.sm_scale)[0].max()))
        if self.stage is not None and mod.indexer is not None:
            logits = _indexer_logits(mod, x.detach(), qr, step)  # [T, S] fp32, grad to the indexer only
            # under tensor parallel q holds this rank's heads: the teacher sums over every rank's heads
            heads = getattr(mod, "head_group", None) or Single()
            if self.stage == "warmup":
                term = _dense_kl(q, rows, logits, step, mod.sm_scale, heads)
            else:
                term = _sparse_kl(q, rows, logits, topk, step, mod.sm_scale, heads)
            # a checkpointed layer's recomputation must save what the forward saved, but records nothing
            if not recomputing():
                self.kl_terms.append(term)


def _indexer_logits(mod: MLAAttention, x: torch.Tensor, qr: torch.Tensor, step: Step) -> torch.Tensor:
    """The indexer's scores of every causal key, as `Indexer.forward` forms them before its top-k."""
    ix = mod.indexer
    t = x.shape[0]
    q = ix._rope(ix.wq_b(qr).view(t, ix.n_heads, ix.head_dim), step)  # [T, H_I, D_I]
    w = ix.weights_proj(x.float()) * (ix.n_heads**-0.5 * ix.head_dim**-0.5)  # [T, H_I]
    return step.backend.indexer_logits(q, ix.keys(x, step), w, step.slots.layout)


def _selected_logits(q, rows, topk, step: Step, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention logits over each query's selected keys: [T, H, k] (-inf at invalid slots), valid [T, k]."""
    logits, valid = [], []
    for q0, q1, s in step.slots.layout.request_bounds():
        idx = topk[q0:q1].long()  # [T_b, k] positions inside the request
        ok = (idx >= 0) & (idx < s)
        keys = rows[q0 : q0 + s][idx.clamp(0, s - 1)].float()  # [T_b, k, c+r]
        lg = torch.einsum("thd,tkd->thk", q[q0:q1].float(), keys) * sm_scale
        logits.append(lg.masked_fill(~ok[:, None, :], float("-inf")))
        valid.append(ok)
    return torch.cat(logits), torch.cat(valid)


def _dense_kl(q, rows, ind_logits, step: Step, sm_scale: float, heads: Group) -> torch.Tensor:
    """Warm-up KL over every causal key, averaged over query rows."""
    terms = []
    for q0, q1, s in step.slots.layout.request_bounds():
        keys = rows[q0 : q0 + s].float()  # training: the request's keys are its own tokens
        att = torch.einsum("thd,sd->ths", q[q0:q1].float(), keys) * sm_scale  # [T_b, H, S_b]
        causal = torch.ones(q1 - q0, s, dtype=torch.bool, device=q.device).tril(s - (q1 - q0))
        att = att.masked_fill(~causal[:, None, :], float("-inf"))
        p = heads.all_reduce(torch.softmax(att, dim=-1).sum(1))
        p = p / p.sum(-1, keepdim=True)  # [T_b, S_b]
        logq = torch.log_softmax(ind_logits[q0:q1, :s].masked_fill(~causal, float("-inf")), dim=-1)
        terms.append(kl_rows(p, logq, causal))
    return torch.cat(terms).mean()


def _sparse_kl(q, rows, ind_logits, topk, step: Step, sm_scale: float, heads: Group) -> torch.Tensor:
    """Sparse-stage KL restricted to each query's selected keys, averaged over query rows."""
    att, valid = _selected_logits(q, rows, topk, step, sm_scale)  # [T, H, k], [T, k]
    p = heads.all_reduce(torch.softmax(att, dim=-1).sum(1))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    sel = ind_logits.gather(1, topk.long().clamp_min(0)).masked_fill(~valid, float("-inf"))
    logq = torch.log_softmax(sel, dim=-1)
    return kl_rows(p, logq, valid).mean()


class ExpertBalancer:
    """Counts the tokens routed to each expert of every router while active; `update()` moves each
    router's `e_score_correction_bias` by gamma toward balance and returns the mean max-violation
    (max load / mean load - 1) seen since the last update."""

    def __init__(self, model: nn.Module, gamma: float = 1e-3) -> None:
        self.gamma, self.active = gamma, True
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.load = [torch.zeros(r.weight.shape[0], dtype=torch.float64) for r in self.routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(mod: Router, args: tuple, output: tuple) -> None:
            if self.active and not recomputing():  # a recomputed layer's routing was counted once
                ids = output[0]
                self.load[i] += torch.bincount(ids.reshape(-1).long().cpu(), minlength=self.load[i].numel())

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @torch.no_grad()
    def update(self, apply: bool = True) -> float:
        viol = []
        for r, load in zip(self.routers, self.load, strict=True):
            if load.sum() == 0:
                continue
            mean = load.mean()
            viol.append(float(load.max() / mean - 1))
            if apply and self.gamma:
                sign = torch.sign(mean - load).to(r.e_score_correction_bias)
                r.e_score_correction_bias.add_(self.gamma * sign)
            load.zero_()
        return sum(viol) / len(viol) if viol else 0.0

"""Language-model and multi-token-prediction losses, every output projection and cross-entropy through
the backend's `linear_cross_entropy` (sequence-chunked; the [N, V] logits never exist at once).

MTP (DeepSeek-V3 section 2.2, GLM-5): prediction step j = 1..n uses MTP layer min(j-1, L-1), so with
GLM-5's single MTP layer every step shares its parameters, plus the shared embedding and output head.
Slot i of step j combines the embedding of token i+j with the previous step's hidden state at i (the
main model's for j = 1) and predicts token i+j+1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.core.attention import Step
from glm5.core.model import GLM5ForCausalLM

IGNORE = -100


@dataclass
class Losses:
    lm: torch.Tensor  # scalar fp32
    mtp: torch.Tensor | None  # mean over prediction steps, or None without MTP
    hidden: torch.Tensor  # [B, S, D] main model output (after the final norm)


def lm_and_mtp(model: GLM5ForCausalLM, ids: torch.Tensor, mtp_steps: int) -> Losses:
    """ids int64 [B, S] -> next-token loss of the main model and the mean MTP loss over `mtp_steps`."""
    out = model(ids, labels=ids, return_logits=False)
    mtp = None
    if mtp_steps > 0:
        if model.config.num_nextn_predict_layers < 1:
            raise ValueError("mtp_steps: the config has no MTP layer (num_nextn_predict_layers=0)")
        h, terms = out.hidden_states, []
        for j in range(1, mtp_steps + 1):
            depth = min(j - 1, model.config.num_nextn_predict_layers - 1)
            tokens, targets = shifted(ids, j)
            x, step = mtp_hidden(model, tokens, h, depth)  # [B*S, D]
            head_in = model.model.layers[model.config.num_hidden_layers + depth].shared_head.norm(x)
            terms.append(model.lm_head.loss(head_in, targets.reshape(-1), step))
            h = x.view_as(h)
        mtp = torch.stack(terms).mean()
    return Losses(out.loss, mtp, out.hidden_states)


def shifted(ids: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (token i+j, 0 past the end) and targets (token i+j+1, IGNORE past the end) of MTP step j."""
    b, s = ids.shape
    tokens = torch.zeros_like(ids)
    targets = torch.full_like(ids, IGNORE)
    if j < s:
        tokens[:, : s - j] = ids[:, j:]
    if j + 1 < s:
        targets[:, : s - j - 1] = ids[:, j + 1 :]
    return tokens, targets


def mtp_hidden(
    model: GLM5ForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor, depth: int
) -> tuple[torch.Tensor, Step]:
    """`GLM5ForCausalLM.mtp_forward` without a cache and without its [B, S, V] logits: tokens [B, S],
    hidden [B, S, D] -> (the MTP layer output [B*S, D] (before `shared_head.norm`), its step)."""
    b, s = tokens.shape
    layer = model.model.layers[model.config.num_hidden_layers + depth]
    step = model.begin_step([s] * b, None)
    emb = model.model.embed_tokens(tokens.reshape(-1))
    # as mtp_forward (and the engines serving MTP weights): position 0 gets a zero embedding
    emb = emb.masked_fill((step.slots.positions == 0)[:, None], 0.0)
    return layer.predict(emb, hidden.reshape(b * s, -1), step), step

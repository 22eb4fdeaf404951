"""Float GLM-5 weights through vLLM's weight iterator, each rank keeping only its slice.

The checkpoint names are glm5/checkpoint.py's (`_hf_names`: per-expert tensors stacked into the
`STACKED_EXPERTS` parameters, the DeepSeek-style MTP copies of the embedding and head); the slices are the
parallel plan's (`glm5.parallel.plan.local_slice`; per expert, the plan's `ShardInfo` of the stacked
parameter). The same function serves vLLM's first load and an in-place update from tensors (an RL trainer
pushing new weights): it copies into the existing parameters, so nothing is reallocated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from glm5.checkpoint import _hf_names, _shared_copies
from glm5.parallel.plan import ShardInfo, local_slice


class CheckpointNames:
    """Checkpoint name -> (parameter name, expert index or None) of the UNSPLIT model (build it before the
    plan is applied: under expert parallel a rank's stacked parameter holds only its experts)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {hf: (sd, e) for hf, sd, e in _hf_names(model)}
        self.copies = _shared_copies(model.config)  # repeated tensors: accepted, not loaded twice
        self.needed = Counter(sd for sd, _ in self.params.values())


def _expert_part(info: ShardInfo | None, e: int, t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(local expert index, this rank's part of expert e's tensor), None when another rank holds expert e."""
    if info is None:
        return e, t
    if info.kind == "experts-ep":
        local = e - info.start
        return (local, t) if 0 <= local < info.length else None
    if info.kind == "experts-tp":  # the stacked parameter's dim d is the per-expert tensor's dim d - 1
        return e, t.narrow(info.dim - 1, info.start, info.length)
    raise ValueError(f"experts: a {info.kind!r} split of a stacked expert parameter is not loadable here")


@torch.no_grad()
def load(model: nn.Module, names: CheckpointNames, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy vLLM's (checkpoint name, full tensor) pairs into `model`'s local parameters -> the names of the
    parameters now completely loaded (a stacked expert parameter once every expert has come)."""
    params = model.state_dict(keep_vars=True)
    plan = getattr(model, "glm5_plan", {})
    seen: Counter[str] = Counter()
    unknown: list[str] = []
    for hf, t in weights:
        if hf in names.copies:
            continue
        entry = names.params.get(hf)
        if entry is None:
            unknown.append(hf)
            continue
        if not t.is_floating_point():
            raise ValueError(f"{hf}: expected a float tensor (a float checkpoint), got {t.dtype}")
        sd, e = entry
        p = params[sd]
        if e is None:
            part = local_slice(model, sd, t)
            if part.shape != p.shape:
                raise ValueError(f"{hf}: expected shape {list(p.shape)}, got {list(part.shape)}")
            p.copy_(part)
        else:
            found = _expert_part(plan.get(sd), e, t)
            if found is not None:
                local, part = found
                if part.shape != p.shape[1:]:
                    raise ValueError(f"{hf}: expected shape {list(p.shape[1:])}, got {list(part.shape)}")
                p[local].copy_(part)
        seen[sd] += 1
    if unknown:
        raise ValueError(
            f"weights: {len(unknown)} tensor(s) GLM-5 does not have, e.g. {unknown[:3]} (not a float "
            f"glm_moe_dsa checkpoint of this config?)"
        )
    done = {sd for sd, n in seen.items() if n == names.needed[sd]}
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in done:
        done.add("lm_head.weight")
    return done

"""GLM-5 checkpoint tensors into a model, each rank keeping only its slice: vLLM's weight iterator into the
plugin's model (glm5/vllm), and the trainer's weight pushes into its rollout engine (glm5/train/rl/engines).

The checkpoint names are glm5/core/checkpoint.py's (`hf_names`: per-expert tensors stacked into the
`STACKED_EXPERTS` parameters, the DeepSeek-style MTP copies of the embedding and head); those of the
quantized linears (compressed-tensors, msModelSlim, GLM-5-FP8) are their formats'
(glm5/weights/quantized.py).
The slices are the parallel plan's (`glm5.parallel.plan.local_slice`; per expert, the plan's `ShardInfo` of
the stacked parameter). The same function serves vLLM's first load and an in-place update from float
tensors (an RL trainer pushing new weights): it copies into the existing parameters, so nothing is
reallocated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from glm5.core.checkpoint import FLOAT_DTYPES, CheckpointError, hf_names, shared_copies
from glm5.parallel.plan import ShardInfo, apply, local_slice
from glm5.weights import quantized as quant_weights

if TYPE_CHECKING:  # the vLLM host's groups; this module imports neither vLLM nor the plugin
    from glm5.vllm.parallel import Groups


class CheckpointNames:
    """Checkpoint name -> (parameter name, expert index or None) of the UNSPLIT model (build it before the
    plan is applied: under expert parallel a rank's stacked parameter holds only its experts); for a
    quantized skeleton (`quant.load.skeleton`) also its quantized linears' tensors -> (base, suffix)."""

    def __init__(self, model: nn.Module) -> None:
        quantized = getattr(model, "quant_format", None) is not None
        self.targets = quant_weights.targets(model) if quantized else {}
        self.quant = {f"{b}.{s}": (b, s) for b, t in self.targets.items() for s in t.stored}
        self.modules: dict[str, set[str]] = {}  # quantized module -> its linears' base names
        for b, t in self.targets.items():
            self.modules.setdefault(t.module, set()).add(b)
        qprefix = tuple(f"{t.module}." for t in self.targets.values() if not t.dequant)
        self.params = {
            hf: (sd, e)
            for hf, sd, e in hf_names(model)
            if hf not in self.quant and not sd.startswith(qprefix)
        }
        self.copies = shared_copies(model.config)  # repeated tensors: accepted, not loaded twice
        self.needed = Counter(sd for sd, _ in self.params.values())


def split_skeleton(glm: nn.Module, groups: Groups) -> CheckpointNames:
    """Split the meta-device model `glm` (float, or a quantized `quant.load.skeleton`) by the plan over
    `groups` (glm5/vllm/parallel.py), then allocate only its local slices, for any load format -> the
    checkpoint names it loads (read before the split: full shapes)."""
    names = CheckpointNames(glm)
    if groups.tp is not None:
        apply(glm, tp=groups.tp, ep=groups.ep, **groups.plan_args())
    glm.to_empty(device=torch.get_default_device())
    if glm.config.tie_word_embeddings and hasattr(glm, "lm_head"):  # an MTP draft has none (the target's)
        glm.lm_head.weight = glm.model.embed_tokens.weight
    glm.requires_grad_(False).eval()
    return names


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


def _copy_float(model: nn.Module, params: dict, plan: dict, hf: str, sd: str, e, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{hf}: expected a float tensor (a float checkpoint), got {t.dtype}")
    p = params[sd]
    if e is None:
        part = local_slice(model, sd, t)
        if part.shape != p.shape:
            raise ValueError(f"{hf}: expected shape {list(p.shape)}, got {list(part.shape)}")
        p.copy_(part)
        return
    found = _expert_part(plan.get(sd), e, t)
    if found is not None:
        local, part = found
        if part.shape != p.shape[1:]:
            raise ValueError(f"{hf}: expected shape {list(p.shape[1:])}, got {list(part.shape)}")
        p[local].copy_(part)


@torch.no_grad()
def load(model: nn.Module, names: CheckpointNames, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy vLLM's (checkpoint name, full tensor) pairs into `model`'s local parameters and buffers -> the
    names of those now completely loaded (a stacked expert parameter once every expert has come). A
    quantized model's load must be complete: a tensor that never came is named."""
    params = model.state_dict(keep_vars=True)
    plan = getattr(model, "glm5_plan", {})
    stream = quant_weights.QuantStream(model, names.quant, names.targets) if names.targets else None
    seen: Counter[str] = Counter()
    came: set[str] = set()
    unknown: list[str] = []
    for hf, t in weights:
        if hf in names.copies:
            continue
        if stream is not None and hf in names.quant:
            stream.add(hf, t)
            came.add(hf)
            continue
        entry = names.params.get(hf)
        if entry is None:
            unknown.append(hf)
            continue
        sd, e = entry
        _copy_float(model, params, plan, hf, sd, e, t)
        came.add(hf)
        seen[sd] += 1
    if unknown:
        raise ValueError(
            f"weights: {len(unknown)} tensor(s) GLM-5 does not have, e.g. {unknown[:3]} (not a "
            f"glm_moe_dsa checkpoint of this config and format?)"
        )
    done = {sd for sd, n in seen.items() if n == names.needed[sd]}
    if stream is not None:
        missing = sorted(set(names.quant).union(names.params) - came)
        if missing:
            raise CheckpointError(missing, [], [])
        for module in names.modules:
            done.update(n for n in params if n.startswith(f"{module}."))
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in done:
        done.add("lm_head.weight")
    return done

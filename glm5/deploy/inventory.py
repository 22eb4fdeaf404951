"""The weight inventory a serving engine loads: every checkpoint tensor of the model, counted from the model's
own parameters (built on the meta device) and the recipe's scheme per weight, in the checkpoint format the
engine reads, with the way vLLM shards it across ranks.

Stored tensors per linear weight [N, K] (quant/formats/*.py, as each format specifies them):
  hf (float):               weight [N, K] at the model's dtype
  modelslim W8A8_DYNAMIC:   weight int8 [N, K], weight_scale fp32 [N, 1], weight_offset fp32 [N, 1]
  modelslim W4A8_DYNAMIC:   weight int8 [N/2, K] (int4 pairs along N), weight_scale, weight_offset [N, 1],
                            scale_bias fp32 [N, 16] (down_proj / o_proj: one sum per K/16 slice) or [N, 1]
  compressed-tensors W8A8:  weight int8 [N, K], weight_scale fp32 [N, 1]
  compressed-tensors W4A8:  weight_packed int32 [N, ceil(K/8)], weight_scale fp32 [N, K/group or 1],
                            weight_shape int64 [2]
  fp8 (GLM-5-FP8):          weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]
Sharding (vLLM DeepseekV2 / GlmMoeDsa, dsa_semantics.md 5): q_b_proj, kv_b_proj, dense and shared-expert
gate/up, embedding and lm_head split their output rows over TP (column parallel); o_proj and the dense and
shared-expert down_proj split their input columns (row parallel); q_a_proj, kv_a_proj_with_mqa, the whole
indexer, the router, norms and the MTP eh_proj are replicated; routed experts are split over the MoE group
(TP x DP ranks): whole experts per rank with expert parallelism, else each expert column / row parallel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from glm5.core.checkpoint import STACKED_EXPERTS
from quant.recipe import W4A8, W8A8, Scheme

FORMATS = ("hf", "modelslim", "compressed-tensors", "fp8")
_ROW_SLICED = ("down_proj", "o_proj", "w2")  # msModelSlim scale_bias [N, 16] leaves
# (pattern over the parameter's module name, role, split); first match wins
_SHARDING: list[tuple[re.Pattern, str, str]] = [
    (re.compile(p), r, s)
    for p, r, s in [
        (r"^model\.embed_tokens$", "embedding", "col"),
        (r"^lm_head$", "lm_head", "col"),
        (r"\.self_attn\.indexer\.", "indexer", "rep"),
        (r"\.self_attn\.(q_b_proj|kv_b_proj)$", "attention", "col"),
        (r"\.self_attn\.o_proj$", "attention", "row"),
        (r"\.self_attn\.", "attention", "rep"),
        (r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)$", "routed_experts", "expert_col"),
        (r"\.mlp\.experts\.\d+\.down_proj$", "routed_experts", "expert_row"),
        (r"\.mlp\.shared_experts\.(gate_proj|up_proj)$", "shared_experts", "col"),
        (r"\.mlp\.shared_experts\.down_proj$", "shared_experts", "row"),
        (r"\.mlp\.gate$", "router", "rep"),
        (r"\.mlp\.(gate_proj|up_proj)$", "dense_mlp", "col"),
        (r"\.mlp\.down_proj$", "dense_mlp", "row"),
        (r"\.eh_proj$", "mtp_proj", "rep"),
        (r"(norm|layernorm)$", "norm", "rep"),
    ]
]


class ShardError(ValueError):
    """A tensor does not split evenly over the ranks a layout gives it."""


@dataclass(frozen=True)
class Part:
    """One stored tensor of a weight. axes: per dim 'n' (output rows), 'k' (input columns), 's' (the K/16
    slices of scale_bias) or '-' (never split)."""

    suffix: str  # '' for a float parameter (its own name), else 'weight_scale', ...
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def shard_bytes(self, split_axes: str, parts: int) -> int:
        """Bytes of one of `parts` equal shards along the first dim whose axis is in `split_axes`."""
        for dim, ax in zip(self.shape, self.axes, strict=True):
            if ax in split_axes and parts > 1:
                if dim % parts:
                    raise ShardError(
                        f"{self.suffix or 'weight'} {list(self.shape)}: dim {dim} does not "
                        f"split over {parts} ranks"
                    )
                return self.nbytes // parts
        return self.nbytes


@dataclass(frozen=True)
class Weight:
    """A checkpoint weight (a module parameter), `count` times for stacked routed experts."""

    name: str  # parameter name; experts: model.layers.L.mlp.experts.{e}.PROJ.weight
    module: str
    scheme: str  # FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC or W4A8_DYNAMIC(g128)
    role: str
    split: str  # rep | col | row | expert_col | expert_row
    count: int
    parts: tuple[Part, ...]
    mtp: bool

    @property
    def nbytes(self) -> int:
        return self.count * sum(p.nbytes for p in self.parts)

    def stored_names(self) -> Iterator[tuple[str, Part]]:
        """(checkpoint tensor name, part) of every stored tensor, experts expanded."""
        for e in range(self.count):
            base = self.name.replace("{e}", str(e))
            mod = base.removesuffix(".weight") if self.scheme != "FLOAT" else base
            for p in self.parts:
                yield (f"{mod}.{p.suffix}" if p.suffix else base), p

    def rank_bytes(self, tp: int, moe_ranks: int, expert_parallel: bool) -> int:
        """Bytes one rank holds: tp = attention tensor-parallel size, moe_ranks = TP x DP."""
        if self.split == "rep":
            return self.nbytes
        if self.split.startswith("expert"):
            if expert_parallel:
                if self.count % moe_ranks:
                    raise ShardError(f"{self.name}: {self.count} experts do not split over {moe_ranks} ranks")
                return self.count // moe_ranks * sum(p.nbytes for p in self.parts)
            tp, split = moe_ranks, self.split.removeprefix("expert_")
        else:
            split = self.split
        axes = "n" if split == "col" else "ks"
        return self.count * sum(p.shard_bytes(axes, tp) for p in self.parts)


def _role(module: str) -> tuple[str, str]:
    for pat, role, split in _SHARDING:
        if pat.search(module):
            return role, split
    raise ValueError(f"module {module}: no sharding rule (glm5/deploy/inventory.py _SHARDING)")


def _quant_parts(n: int, k: int, s: Scheme, fmt: str, leaf: str, bias: bool, split: str) -> list[Part]:
    b_ax = ("n",) if split.endswith("col") else ("-",)
    g = k // (s.group_size or k)
    if fmt == "modelslim":
        if s.name == W4A8 and s.group_size:
            raise ValueError(
                f"format modelslim: W4A8 is per channel only (vllm-ascend v1), got group_size {s.group_size}"
            )
        rows = n // 2 if s.name == W4A8 else n
        out = [
            Part("weight", (rows, k), 1, ("n", "k")),
            Part("weight_scale", (n, 1), 4, ("n", "-")),
            Part("weight_offset", (n, 1), 4, ("n", "-")),
        ]
        if s.name == W4A8:
            out.append(
                Part("scale_bias", (n, 16), 4, ("n", "s"))
                if leaf in _ROW_SLICED
                else Part("scale_bias", (n, 1), 4, ("n", "-"))
            )
    elif fmt == "fp8":  # GLM-5-FP8: e4m3 weight + fp32 weight_scale_inv per 128 x 128 block
        out = [
            Part("weight", (n, k), 1, ("n", "k")),
            Part("weight_scale_inv", (-(-n // 128), -(-k // 128)), 4, ("n", "k")),
        ]
    elif fmt == "compressed-tensors":
        if s.name == W4A8:
            out = [
                Part("weight_packed", (n, -(-k // 8)), 4, ("n", "k")),
                Part("weight_shape", (2,), 8, ("-",)),
            ]
        else:
            out = [Part("weight", (n, k), 1, ("n", "k"))]
        out.append(Part("weight_scale", (n, g), 4, ("n", "k" if g > 1 else "-")))
    else:
        raise ValueError(f"format: quantized weights need 'modelslim' or 'compressed-tensors', got {fmt!r}")
    if bias:
        out.append(Part("bias", (n,), 4, b_ax))
    return out


def inventory(model: nn.Module, plan: dict[str, Scheme], fmt: str) -> list[Weight]:
    """Every checkpoint tensor of `model` (meta device is enough) with `plan` applied, stored as `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "hf" and plan:
        raise ValueError(
            "fmt: 'hf' holds float weights only; a quantization plan needs modelslim or compressed-tensors"
        )
    c = model.config
    mtp_prefix = tuple(f"model.layers.{c.num_hidden_layers + j}." for j in range(c.num_nextn_predict_layers))
    biased = {n.removesuffix(".bias") for n, _ in model.named_parameters() if n.endswith(".bias")}
    out: list[Weight] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied lm_head: stored once
            continue
        seen.add(id(p))
        m = STACKED_EXPERTS.match(name)
        count, shape = (p.shape[0], tuple(p.shape[1:])) if m else (1, tuple(p.shape))
        wname = f"{m.group(1)}.{{e}}.{m.group(2)}.weight" if m else name
        module = f"{m.group(1)}.0.{m.group(2)}" if m else name.rsplit(".", 1)[0]
        role, split = _role(module)
        is_mtp = name.startswith(mtp_prefix)
        scheme = plan.get(module)
        if scheme is not None and name.endswith(".bias"):
            continue  # stored with its quantized weight (fp32)
        if scheme is None:
            if len(shape) == 2:
                axes: tuple[str, ...] = ("n", "k")
            elif name.endswith(".bias") and split.endswith("col"):
                axes = ("n",)
            else:
                axes = ("-",) * len(shape)
            parts: tuple[Part, ...] = (Part("", shape, p.element_size(), axes),)
            label = "FLOAT"
        else:
            n, k = shape
            parts = tuple(_quant_parts(n, k, scheme, fmt, module.rsplit(".", 1)[1], module in biased, split))
            label = scheme.name + (f"(g{scheme.group_size})" if scheme.group_size else "")
        out.append(Weight(wname, module, label, role, split, count, parts, is_mtp))
    return out


def totals(weights: list[Weight], key: str = "role") -> dict[str, int]:
    """Stored bytes summed by `role`, `scheme` or `split`."""
    out: dict[str, int] = {}
    for w in weights:
        out[getattr(w, key)] = out.get(getattr(w, key), 0) + w.nbytes
    return out


def meta_model(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model on the meta device (shapes and dtypes only, no memory)."""
    from glm5.core.model import GLM5ForCausalLM

    with torch.device("meta"):
        return GLM5ForCausalLM(config, backend="reference", dtype=dtype)


__all__ = ["FORMATS", "Part", "ShardError", "W4A8", "W8A8", "Weight", "inventory", "meta_model", "totals"]

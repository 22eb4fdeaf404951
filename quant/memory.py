"""Weight bytes per scheme and KV-cache room for a preset, counted from the model built on the meta device.

Bytes are what the quantized modules hold at run time: W8A8 int8 [N, K] + fp32 scale [N]; W4A8 packed
[N, K/2] + fp32 scales [N, K/group]; float tensors at the dtype the model gives them (bf16, with the
router and indexer head weights in fp32 as glm5/ builds them). KV per token and layer: the MLA latent
row (kv_lora_rank + qk_rope_head_dim = 576) and, where the layer has an indexer, its key (index_head_dim
= 128): bf16 1152 + 256 bytes, or fp8 656 + 132 bytes (FlashMLA / DeepSeek-V3.2 layouts with scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.core.checkpoint import STACKED_EXPERTS
from glm5.core.config import GLM5Config
from quant.apply import plan_model
from quant.recipe import W4A8, Recipe, Scheme

GIB = 1 << 30
#: name -> (devices, GiB per device). Atlas 800T A3: 16 dies x 64 GB HBM; HGX H200: 8 x 141 GB
#: (nvidia-smi reports 143771 MiB = 140.4 GiB per H200).
MACHINES = {"Atlas 800T A3 (16 x 64 GB)": (16, 64.0), "8 x H200 (8 x 141 GB)": (8, 140.4)}
CONTEXTS = {"128K": 131072, "200K": 202752}  # 202752 = max_position_embeddings
KV_BYTES = {"bf16": (576 * 2, 128 * 2), "fp8": (656, 132)}


@dataclass
class WeightBytes:
    total: int
    mtp: int
    by_scheme: dict[str, int]


def _qbytes(n: int, k: int, s: Scheme) -> int:
    if s.name == W4A8:
        return n * k // 2 + n * (k // (s.group_size or k)) * 4
    return n * k + n * 4


def weight_bytes(model: torch.nn.Module, plan: dict[str, Scheme]) -> WeightBytes:
    c = model.config
    mtp_prefix = tuple(f"model.layers.{c.num_hidden_layers + j}." for j in range(c.num_nextn_predict_layers))
    total = mtp = 0
    by: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        m = STACKED_EXPERTS.match(name)
        mod = f"{m.group(1)}.0.{m.group(2)}" if m else name.rsplit(".", 1)[0]
        s = plan.get(mod) if name.endswith(".weight") or m else None
        if s is None:
            b, key = p.numel() * p.element_size(), "FLOAT"
        else:
            e = p.shape[0] if m else 1
            key = s.name + (f"(g{s.group_size})" if s.group_size else "")
            b = e * _qbytes(p.shape[-2], p.shape[-1], s)
        by[key] = by.get(key, 0) + b
        total += b
        if name.startswith(mtp_prefix):
            mtp += b
    return WeightBytes(total, mtp, by)


def kv_bytes_per_token(config: GLM5Config, kind: str, with_mtp: bool) -> int:
    latent, idx = KV_BYTES[kind]
    mtp = config.num_nextn_predict_layers if with_mtp else 0
    layers = [t == "full" for t in config.indexer_types] + [True] * mtp
    return sum(latent + (idx if has else 0) for has in layers)


def preset_model(preset: str) -> torch.nn.Module:
    from glm5.core.model import GLM5ForCausalLM

    with torch.device("meta"):
        return GLM5ForCausalLM(GLM5Config.from_preset(preset), backend="reference", dtype=torch.bfloat16)


def memory_table(
    preset: str = "glm5-744b",
    recipe_names: tuple[str, ...] = ("glm5-w8a8", "glm5-w4a8"),
    utilization: float = 0.9,
    with_mtp: bool = False,
) -> list[dict]:
    """One row per (scheme, machine): weights, KV room, and how many full 128K / 200K contexts fit."""
    model = preset_model(preset)
    plans = {"bf16": {}} | {r: plan_model(model, Recipe.load(r)) for r in recipe_names}
    rows = []
    for scheme, plan in plans.items():
        wb = weight_bytes(model, plan)
        weights = wb.total - (0 if with_mtp else wb.mtp)
        for mname, (n, gib) in MACHINES.items():
            cap = n * gib * GIB
            room = utilization * cap - weights
            row = {
                "scheme": scheme,
                "machine": mname,
                "weights_gib": weights / GIB,
                "capacity_gib": cap / GIB,
                "kv_room_gib": room / GIB,
                "fits": room > 0,
            }
            for kind in KV_BYTES:
                per_tok = kv_bytes_per_token(model.config, kind, with_mtp)
                for cname, ctx in CONTEXTS.items():
                    row[f"seqs_{cname}_{kind}"] = max(room, 0) / (per_tok * ctx)
            rows.append(row)
    return rows

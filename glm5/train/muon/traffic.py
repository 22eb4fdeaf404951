"""The analytic Muon traffic of distributed Muon Split (glm5/train/muon/sharded.py): bytes a rank moves per
step under the naive, owner and split schemes, for any GLM-5 config (meta device, nothing allocated)."""

from __future__ import annotations

import torch

from glm5.train.muon.layout import CATEGORIES, SCHEMES, Layout, category, chunk_ranges
from glm5.train.muon.optimizer import Blocks, blocks_for, uses_adamw


def muon_params(config, mode: str = "muon-split") -> list[tuple[str, tuple[int, ...], Blocks]]:
    """(name, full shape, Blocks) of every Muon parameter of a GLM-5 model with this config (meta device)."""
    from glm5.core.model import GLM5ForCausalLM

    with torch.device("meta"):
        model = GLM5ForCausalLM(config)
    return [
        (n, tuple(p.shape), blocks_for(n, p, config, split=mode == "muon-split"))
        for n, p in model.named_parameters()
        if p.requires_grad and not uses_adamw(n, p)
    ]


def muon_bytes(
    config, world: int, scheme: str, element_size: int = 4, params: list | None = None
) -> dict[str, float]:
    """Bytes a rank receives (= sends, averaged over the ranks) per Muon step, by category and 'total',
    when every Muon parameter is sharded FSDP-style on dim 0 over `world` ranks.

    naive: every matrix all-gathered, each rank receives (world - 1) shards of it. owner: one owner per
    matrix gathers the shards and scatters the result, 2 (world - 1) shards a matrix over all ranks.
    split: as owner, but matrices whose shards hold whole blocks (heads, experts) move nothing.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    out = dict.fromkeys(CATEGORIES, 0.0)
    for _, shape, blk in params if params is not None else muon_params(config):
        lay = Layout(shape, 0, chunk_ranges(shape[0], world), 0)
        chunk = lay.padded_numel() * element_size
        if scheme == "naive":
            moved = chunk * (world - 1)
        elif scheme == "split" and lay.local_blocks(blk) is not None:
            moved = 0
        else:
            moved = 2 * chunk * (world - 1) / world
        out[category(blk, shape)] += moved
    out["total"] = sum(out.values())
    return out

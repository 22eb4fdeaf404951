"""Sequence parallel for the norms (Megatron's, on the tp group): between the main decoder layers' token
mixing the residual stream is split by tokens, so the RMSNorms and the residual adds run on this rank's
T / tp rows instead of on every token on every rank.

    embedding output x [T, D] (whole on every tp rank)
      -> scatter at the first layer: this rank's rows [T/tp, D]      (free; backward: all-gather)
    each main layer:
      input_layernorm on the rows -> gather [T, D]                   (all-gather; backward: the rows)
      attention (heads over tp) -> o_proj's partial sums reduce-scattered to the rows
      residual add on the rows, post_attention_layernorm on the rows -> gather [T, D]
      MLP / MoE (tp) -> down_proj's (and the routed experts') partial sums reduce-scattered to the rows
      residual add on the rows
      -> gather after the last main layer: [T, D] for the final norm, the MTP layer and the losses

Each all-reduce of plain tensor parallel becomes a reduce-scatter (glm5/parallel/plan.py's `_rowwise`
with sp), and each norm's output is all-gathered: a dense layer moves the same bytes, an MoE layer (its
routed and shared outputs reduced apart) one all-gather fewer; the norms' and residual adds' work and
activations are divided by tp. The MTP layer (called through its own `predict`, not as a layer of the stack)
runs without it.

A norm's weight is a whole copy on every tp rank, but each rank's gradient of it comes from its own rows
only: the Layouts mark it `partial` (glm5/parallel/layout.py) and the trainer sums it over the group before
the step (glm5/train/distributed/runtime.py, `Dist.sync_replicated_grads`).

A step's tokens must divide by tp (`scatter` says so in one line otherwise). In the layout-invariant mode
the exact row-parallel sum is computed whole and each rank keeps its rows: a norm and an add are row-wise,
so the forward has the plain tensor-parallel bits.
"""

from __future__ import annotations

import re

from torch import nn

from glm5.parallel.group import Group, gather, scatter

NORMS = ("input_layernorm", "post_attention_layernorm")


def in_region(name: str, config) -> bool:
    """True for a module inside a main decoder layer (the MTP layer, called through its own `predict`,
    runs without sequence parallel)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) < config.num_hidden_layers


def apply(model: nn.Module, group: Group) -> tuple[str, ...]:
    """Install the scatter / gather points on the main decoder layers; the names of the norm weights whose
    gradients are partial sums over `group`."""
    layers = model.model.layers[: model.config.num_hidden_layers]
    layers[0].register_forward_pre_hook(lambda m, a: (scatter(a[0], group), *a[1:]))
    layers[-1].register_forward_hook(lambda m, a, out: (gather(out[0], group, 0), *out[1:]))
    partial = []
    for i, layer in enumerate(layers):
        for norm in NORMS:
            getattr(layer, norm).register_forward_hook(lambda m, a, out: gather(out, group, 0))
            partial.append(f"model.layers.{i}.{norm}.weight")
    return tuple(partial)

"""GLM-5's one parallel plan: how each module is split over a tensor-parallel group (and, optionally, its
routed experts over an expert-parallel group), applied from outside the model file for both hosts.

The split is vLLM's for DeepSeek-V3.2 / GLM-5 (Megatron's tensor parallelism):

| modules | style | weight split | communication |
|---|---|---|---|
| `self_attn.q_b_proj`, `self_attn.kv_b_proj` | heads | whole heads (dim 0) | replicated input enters |
| `self_attn.o_proj`, `mlp.down_proj`, `shared_experts.down_proj` | rowwise | dim 1 | output summed |
| `mlp.gate_proj/up_proj`, `shared_experts.gate_proj/up_proj` | colwise | dim 0 | input enters |
| `mlp.experts` (tp) | experts-tp | intermediate dim of every expert | input enters, output summed |
| `mlp.experts` (ep) | experts-ep | whole experts | routed rows dispatched and combined (exact) |
| `model.embed_tokens`, `lm_head` | vocab | dim 0 (vocabulary rows) | exact sum / gather / sharded loss |
| `q_a_proj`, `kv_a_proj_with_mqa`, norms, router, indexer, `eh_proj` | replicated | - | - |

The backends see local shapes only: attention runs on the rank's heads (the model reads the head count
from the weights), `grouped_matmul` on the rank's experts or intermediate slice. The indexer and router
are replicated, so every rank computes the same top-k from the same bits (checked, not hoped for, by
glm5/parallel/agreement.py under GLM5_VALIDATE).

`apply` slices the model's parameters in place (on the meta device it only makes them local-sized, for
a loader that then reads each rank's slice with `local_slice`). It records where every tensor lies in one
table, `model.glm5_plan` (glm5/parallel/layout.py: a `ShardInfo` per split tensor, by name), which the
loaders, optimizers, gradient clip and checkpoints read; nothing is stored on the tensors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from backends import Backend
from backends.moe import expert_parallel as expert_dispatch
from glm5.core.moe import Experts
from glm5.parallel import invariant, sequence
from glm5.parallel.group import Group, enter, gather, reduce, reduce_scatter, scatter
from glm5.parallel.layout import Layouts, ShardInfo


class PlanError(ValueError):
    """The model cannot be split this way (a count not divisible by the group size)."""


# -- the rules ------------------------------------------------------------------------------------------
#: (module-name pattern, style); the first match wins, unmatched modules are replicated
RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens", "vocab-embedding"),
    (r"lm_head", "vocab-head"),
    (r".*\.self_attn", "attention"),
    (r".*\.mlp\.experts", "experts"),
    (r".*\.mlp\.shared_experts", "mlp"),
    (r".*\.mlp", "mlp"),
)


def style_of(name: str) -> str | None:
    for pattern, style in RULES:
        if re.fullmatch(pattern, name):
            return style
    return None


# -- slicing --------------------------------------------------------------------------------------------
def _split(
    module: nn.Module, pname: str, kind: str, dim: int, group: Group, unit: int = 1, halves: int = 1
) -> None:
    """Replace parameter (or buffer) `pname` of `module` by this rank's slice along `dim` (a whole number
    of units). halves=2: the dim holds two stacked halves (a fused gate|up), each split the same way."""
    p = getattr(module, pname)
    full = tuple(p.shape)
    if full[dim] % (group.size * unit * halves):
        raise PlanError(
            f"{kind}: dimension {dim} of a {full} tensor ({full[dim] // unit} units of {unit}) does not "
            f"split into {group.size} equal whole parts"
        )
    info = ShardInfo(kind, dim, group.rank, group.size, full, unit, group)
    if halves == 1:
        local = p.detach().narrow(dim, info.start, info.length)
    else:
        per = full[dim] // halves // group.size
        parts = (
            p.detach().unflatten(dim, (halves, full[dim] // halves)).narrow(dim + 1, group.rank * per, per)
        )
        local = parts.flatten(dim, dim + 1)
    local = local if p.is_meta else local.clone()
    module.__dict__.setdefault("_glm5_split", {})[pname] = info  # `apply` collects it into the Layouts
    if pname in module._buffers:
        module._buffers[pname] = local
        return
    setattr(module, pname, nn.Parameter(local, requires_grad=p.requires_grad))


def _split_linear(lin: nn.Module, kind: str, dim: int, group: Group, unit: int = 1) -> None:
    """Split a linear layer's [N, K] weight along dim (0: output rows, 1: input columns). A layer other
    than nn.Linear (the quantized ones) says which of its tensors follow with `parallel_split`."""
    if isinstance(lin, nn.Linear):
        _split(lin, "weight", kind, dim, group, unit)
        if lin.bias is not None and dim == 0:
            _split(lin, "bias", kind, 0, group, unit)
        lin.out_features, lin.in_features = lin.weight.shape
    elif hasattr(lin, "parallel_split"):

        def split(name: str, tdim: int, halves: int = 1, unit_: int | None = None) -> None:
            # a head's rows are the unit of dim 0; a tensor in other units (block scales) names its own
            units = (unit if tdim == 0 else 1) if unit_ is None else unit_
            _split(lin, name, kind, tdim, group, units, halves)

        lin.parallel_split(dim, group.size, split)
    else:
        raise PlanError(f"{type(lin).__name__}: declares no `parallel_split`, so the plan cannot split it")


def _enter_input(group: Group):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (enter(args[0], group), *args[1:])

    return hook


def _reduce_output(group: Group, sp: bool):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(out, group) if sp else reduce(out, group)

    return hook


def _rowwise(lin: nn.Linear, group: Group, sp: bool = False) -> None:
    """Split the input dim; the partial outputs are summed over the group (sp: each rank keeps its chunk
    of the tokens, glm5/parallel/sequence.py). In the layout-invariant mode the product itself sums exact
    integer partials over the group (SPEC 12), so the float sum is skipped."""
    _split_linear(lin, "rowwise", 1, group)
    # nn.Linear, or a quantized linear with exact integer partials
    exact = isinstance(lin, nn.Linear) or getattr(lin, "exact_split_product", False)
    k_total = lin.in_features * group.size if exact else None

    split = invariant.RowSplit(group, k_total) if k_total is not None else None
    plain = lin.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not invariant.active():
            return reduce_scatter(plain(x), group) if sp else reduce(plain(x), group)
        if split is None:
            raise invariant.NotLayoutInvariant(
                f"{type(lin).__name__}: a row-parallel layer other than nn.Linear has no exact "
                "split product in the layout-invariant mode"
            )
        if isinstance(lin, nn.Linear):
            y = invariant.linear(x, lin.weight, lin.bias, split)
        else:
            y = plain(x, split=split)  # a quantized linear: quant/invariant.py takes the split
        return scatter(y, group) if sp else y

    lin.forward = forward  # the split is the product's argument (SPEC 12), not state read by the next op


def _attention(attn: nn.Module, group: Group, sp: bool) -> None:
    attn.head_group = group  # whose heads sum to the whole layer (the DSA teacher reads it; survives FSDP)
    _split_linear(attn.q_b_proj, "heads", 0, group, attn.nope + attn.rope)
    _split_linear(attn.kv_b_proj, "heads", 0, group, attn.nope + attn.v_dim)
    attn.q_b_proj.register_forward_pre_hook(_enter_input(group))
    attn.latent.register_forward_hook(lambda m, a, out: enter(out, group))
    _rowwise(attn.o_proj, group, sp)


def _mlp(mlp: nn.Module, group: Group, sp: bool) -> None:
    _split_linear(mlp.gate_proj, "colwise", 0, group)
    _split_linear(mlp.up_proj, "colwise", 0, group)
    mlp.register_forward_pre_hook(_enter_input(group))
    _rowwise(mlp.down_proj, group, sp)


def _experts_tp(experts: nn.Module, group: Group, sp: bool) -> None:
    """Every expert's intermediate dim split (vLLM's MoE without expert parallel)."""
    if isinstance(experts, Experts):
        _split(experts, "gate_proj", "experts-tp", 1, group)
        _split(experts, "up_proj", "experts-tp", 1, group)
        _split(experts, "down_proj", "experts-tp", 2, group)
    elif hasattr(experts, "parallel_split"):
        experts.parallel_split(
            -1,
            group.size,
            lambda name, tdim, halves=1: _split(experts, name, "experts-tp", tdim, group, 1, halves),
        )
    else:
        raise PlanError(
            f"{type(experts).__name__}: declares no `parallel_split`, so the plan cannot split it"
        )

    def refuse_invariant(module: nn.Module, args: tuple) -> None:
        if invariant.active():
            raise invariant.NotLayoutInvariant(
                "experts: experts split on the intermediate dim (tp without ep) have no exact split product "
                "in the layout-invariant mode; split them by expert (ep), which is invariant"
            )

    experts.register_forward_pre_hook(refuse_invariant)
    # the routing weights enter too: each rank's partial output carries only its part of their gradient
    experts.register_forward_pre_hook(lambda m, a: (enter(a[0], group), a[1], enter(a[2], group), *a[3:]))
    experts.register_forward_hook(_reduce_output(group, sp))


class ExpertParallel(nn.Module):
    """Whole experts per rank, mixed into any experts module with `rows` (float, W8A8/W4A8, FP8): its
    stacked tensors keep this rank's `E / size` experts, under their own names.

    The routed (token, slot) rows travel to the rank holding their expert and back
    (backends/moe/expert_parallel.py, SPEC 11.1): each rank runs its experts on the rows routed to them
    only, and combine adds each token's slots in slot order, so the result equals the unsplit layer's
    bits wherever each expert row does (a `batch_invariant` grouped_matmul).

    `ep_tokens`: "replicated" (the expert group is the tensor-parallel group, or ranks holding copies:
    every rank has every token) splits the tokens into `size` chunks, each rank dispatches its chunk
    and the chunks' outputs are gathered; "local" (experts across data-parallel ranks) dispatches the
    rank's own tokens; "tp" (data-parallel attention with tensor parallel: the expert group is the data x
    tensor-parallel ranks, a tensor-parallel group holding the same tokens) chunks the tokens over the
    tensor-parallel group, dispatches each chunk over the expert group and gathers the chunks' outputs
    over the tensor-parallel group. `ep_copies` is the group the tokens are chunked over (the expert
    group, the tensor-parallel group, or None). `ep_capacity`: None, the contiguous mode (one host read
    of the split sizes per layer); an int C, the masked mode (C rows per expert and source rank, fixed
    shapes, no host read; slots past C are dropped and added to `ep_dropped`, an int64 counter on the
    experts' device).
    `ep_masked_tokens`: an int N (replicated tokens, no `ep_capacity`): steps of at most N tokens per rank
    take the masked mode with capacity N (no slot can drop: a token routes to an expert at most once),
    larger ones the contiguous mode (SPEC 11.1); every rank holds the same tokens, so chooses the same.
    """

    ep_group: Group
    ep_first: int
    ep_local: int
    ep_tokens: str = "replicated"
    ep_copies: Group | None = None
    ep_capacity: int | None = None
    ep_masked_tokens: int | None = None
    ep_dropped: torch.Tensor

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, be: Backend) -> torch.Tensor:
        g = self.ep_copies
        if g is None:
            return self._routed(x, ids, w, be).to(x.dtype)
        t = x.shape[0]
        c = -(-t // g.size)
        a, b = min(g.rank * c, t), min(g.rank * c + c, t)
        x, w = enter(x, g), enter(w, g)  # each rank's chunk carries only its part of their gradient
        y = self._routed(x[a:b], ids[a:b], w[a:b], be).to(x.dtype)
        y = torch.cat([y, y.new_zeros(c - (b - a), y.shape[1])]) if b - a < c else y
        return gather(y, g, 0)[:t]

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, be: Backend) -> torch.Tensor:
        g = self.ep_group
        # a host with fused kernels (DeepEP, MC2) offers the same three steps on its group
        steps = getattr(g, "expert_steps", None) or expert_dispatch
        lay = steps.layout(ids, self.ep_local * g.size)
        capacity = self.ep_capacity
        if capacity is None and self.ep_tokens == "replicated" and self.ep_masked_tokens is not None:
            capacity = self.ep_masked_tokens if x.shape[0] <= self.ep_masked_tokens else None
        got, d, h = steps.dispatch(x, lay, g, capacity)
        y = steps.combine(self.rows(got, d, be), w, h, g)
        if capacity is not None:
            self.ep_dropped = self.ep_dropped.to(h.dropped.device) + h.dropped
        return y


_EP_CLASSES: dict[type, type] = {}


def _expert_parallel(
    experts: nn.Module,
    group: Group,
    tokens: str,
    capacity: int | None,
    masked_tokens: int | None,
    tp: Group | None = None,
) -> None:
    """Keep this rank's whole experts of every stacked tensor (dim 0 = the expert) and compute through
    ExpertParallel.forward (`tp`: the group holding this rank's tokens, for `tokens` "tp")."""
    if not hasattr(experts, "rows"):
        raise PlanError(f"{type(experts).__name__}: an experts module needs `rows` to be split by expert")
    n = (
        next(t for t in experts.parameters() if t.dim() == 3).shape[0]
        if any(t.dim() == 3 for t in experts.parameters())
        else experts.n_experts
    )
    for name, t in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        if t is not None and t.dim() >= 1 and t.shape[0] == n:
            _split(experts, name, "experts-ep", 0, group)
    cls = type(experts)
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    experts.__class__ = _EP_CLASSES[cls]
    experts.ep_group, experts.ep_first, experts.ep_local = (
        group,
        group.rank * (n // group.size),
        n // group.size,
    )
    experts.ep_tokens, experts.ep_capacity, experts.ep_masked_tokens = tokens, capacity, masked_tokens
    copies = {"replicated": group, "local": None, "tp": tp if tp is not None and tp.size > 1 else None}
    experts.ep_copies = copies[tokens]
    experts.ep_dropped = torch.zeros((), dtype=torch.int64)
    if hasattr(experts, "n_experts"):
        experts.n_experts = n // group.size


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split over the group; each token's row comes from the one rank holding it (the
    sum over ranks adds zeros to it, so the result is the unsplit embedding's bits)."""

    def __init__(self, emb: nn.Embedding, group: Group) -> None:
        super().__init__()
        self.register_parameter("weight", emb.weight)
        _split(self, "weight", "vocab", 0, group)
        self.group = group
        self.first = group.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rel = ids.to(torch.int64) - self.first
        mine = (rel >= 0) & (rel < self.weight.shape[0])
        e = nn.functional.embedding(torch.where(mine, rel, 0), self.weight)
        zero = torch.zeros((), dtype=e.dtype, device=e.device)
        return reduce(torch.where(mine[..., None], e, zero), self.group)


def _vocab_head(head: nn.Module, group: Group) -> None:
    """lm_head split by vocabulary rows: logits gathered in rank order; the loss on the split vocabulary
    (glm5/parallel/vocab.py: the backend's per-shard statistics, combined over the group)."""
    from glm5.parallel.head import VocabParallelHead

    _split_linear(head, "vocab", 0, group)
    head.__class__ = VocabParallelHead
    head.group = group
    head.register_forward_pre_hook(_enter_input(group))
    head.register_forward_hook(lambda m, a, out: gather(out, group, -1))


# -- applying the plan ----------------------------------------------------------------------------------
def check(config, tp: int, ep: int = 1) -> None:
    """PlanError naming the first config count that does not split over tp (and ep) ranks: checked before
    any parameter is touched, so a refused plan leaves the model whole."""
    counts = [
        ("num_attention_heads", config.num_attention_heads, tp),
        ("vocab_size", config.vocab_size, tp),
        ("intermediate_size", config.intermediate_size, tp),
    ]
    if config.n_shared_experts:
        counts.append(
            (
                "moe_intermediate_size * n_shared_experts",
                config.moe_intermediate_size * config.n_shared_experts,
                tp,
            )
        )
    if config.n_routed_experts:
        counts.append(
            ("n_routed_experts", config.n_routed_experts, ep)
            if ep > 1
            else ("moe_intermediate_size", config.moe_intermediate_size, tp)
        )
    for name, n, ranks in counts:
        if n % ranks:
            raise PlanError(f"{name}: {n} does not split over {ranks} ranks")
    if tp > 1 and config.tie_word_embeddings:
        raise PlanError("tie_word_embeddings: a tied head is not split by this plan (GLM-5 does not tie)")
    if tp > 1 and config.attention_bias:
        raise PlanError(
            "attention_bias: a row-parallel o_proj with a bias is not split by this plan (GLM-5 has none)"
        )


def apply(
    model: nn.Module,
    tp: Group,
    ep: Group | None = None,
    ep_tokens: str = "replicated",
    ep_capacity: int | None = None,
    ep_masked_tokens: int | None = None,
    sequence_parallel: bool = False,
) -> Layouts:
    """Split a GLM5ForCausalLM in place over `tp` (experts over `ep` when given: whole experts per rank,
    the attention still over `tp`) and return its Layouts (glm5/parallel/layout.py: the ShardInfo of every
    split tensor by name, the group holding copies of the rest), kept as `model.glm5_plan`.
    `ep_tokens` / `ep_capacity`: how the expert group's ranks hold tokens and which dispatch mode runs
    (ExpertParallel): "replicated" when they hold the same tokens (ep = tp, or copies), "local" when
    each holds its own (experts across data-parallel ranks), "tp" when each tensor-parallel group holds its
    own (experts across data x tensor-parallel ranks, `ep` a multiple of `tp`); `ep_masked_tokens`: the
    masked mode for steps of at most that many tokens per rank, the contiguous mode above (a serving
    engine's decode bound).
    `sequence_parallel` (training, tp > 1, no ep): the decoder layers' norms and residual adds run on each
    rank's chunk of the tokens (glm5/parallel/sequence.py).

    Call it once, on the full model (random or loaded: each rank keeps its slice and frees the rest) or
    on the meta device before a loader fills the local slices (`local_slice`). Tied embeddings stay tied.
    """
    if getattr(model, "glm5_plan", None) is not None:
        raise PlanError("model: a parallel plan is already applied")
    if ep_tokens not in ("replicated", "local", "tp"):
        raise PlanError(f"ep_tokens: expected 'replicated', 'local' or 'tp', got {ep_tokens!r}")
    if ep_tokens == "tp" and ep is not None and ep.size % tp.size:
        raise PlanError(
            f"ep_tokens: 'tp' needs an expert group of whole tp groups, got {ep.size} over {tp.size}"
        )
    check(model.config, tp.size, 1 if ep is None else ep.size)
    for arg, value in (("ep_capacity", ep_capacity), ("ep_masked_tokens", ep_masked_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise PlanError(f"{arg}: expected an integer >= 1 or None, got {value!r}")
    if sequence_parallel and (tp.size == 1 or ep is not None and ep.size > 1):
        raise PlanError("sequence_parallel: runs over the tp group, with tp > 1 and no expert parallel")
    for name, module in list(model.named_modules()):
        style = style_of(name)
        if style is None or tp.size == 1 and style != "experts":
            continue
        sp = sequence_parallel and sequence.in_region(name, model.config)
        if style == "attention":
            _attention(module, tp, sp)
        elif style == "mlp" and not hasattr(module, "experts"):  # the dense MLP or the shared expert
            _mlp(module, tp, sp)
        elif style == "experts":
            if ep is not None and ep.size > 1:
                _expert_parallel(module, ep, ep_tokens, ep_capacity, ep_masked_tokens, tp)
            elif tp.size > 1:
                _experts_tp(module, tp, sp)
        elif style == "vocab-embedding":
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, VocabParallelEmbedding(module, tp))
        elif style == "vocab-head":
            _vocab_head(module, tp)
    if hasattr(model, "prepare_weights"):
        model.prepare_weights()  # layers that lay their weights out for the backend do it again, once
    shards = {}
    for prefix, module in model.named_modules():
        for pname, info in module.__dict__.pop("_glm5_split", {}).items():
            shards[f"{prefix}.{pname}" if prefix else pname] = info
    # the ranks of tp (or of ep over ranks holding the same tokens) hold whole copies of the rest
    copies = tp if tp.size > 1 else ep if ep is not None and ep_tokens == "replicated" else None
    partial = sequence.apply(model, tp) if sequence_parallel else ()
    model.glm5_plan = Layouts(shards, copies, partial)
    return model.glm5_plan


def local_slice(model: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor for parameter `name` of a model `apply` split (the tensor
    itself for a replicated one): what a loader copies into the local parameter."""
    info = getattr(model, "glm5_plan", {}).get(name)
    if info is None:
        return full
    if tuple(full.shape) != info.full_shape:
        raise PlanError(f"{name}: expected the full shape {info.full_shape}, got {tuple(full.shape)}")
    return full.narrow(info.dim, info.start, info.length)

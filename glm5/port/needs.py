"""Which ops (and which dtype of each op's axis, cache layouts, backward) running GLM-5 needs, for a config
and a quantization recipe: derived by running the model code, not listed by hand.

A miniature of the config (the same layer kinds, routing, shared expert, dense layers and MTP; small sizes)
runs on a reference backend that records every op call: greedy generation with ragged and paged caches,
MTP speculative decoding, and with `train` a loss, the DSA indexer KL loss and a backward. Sizes do not
change which ops run, only their shapes, so the miniature calls what the full model calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.cache_layout import cache_kind
from backends.contract.ops import OPS
from backends.hooks import Hook
from backends.layout import SeqLayout
from backends.reference import ReferenceBackend

#: the sizes of the miniature (the tiny preset's)
_SMALL = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NeedsError(ValueError):
    """A config or recipe that cannot be read (one line naming it)."""


@dataclass
class Needed:
    op: str
    dtype: str
    layouts: set[str] = field(default_factory=set)
    backward: bool = False
    calls: int = 0
    during: set[str] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "dtype": self.dtype,
            "layouts": sorted(self.layouts),
            "backward": self.backward,
            "calls": self.calls,
            "during": sorted(self.during),
        }


class Recorder(ReferenceBackend):
    """The reference backend, writing down (op, dtype of its axis, layout, backward) of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, str], Needed] = {}
        self.phase = ""
        self.hooks = (_Record(self),)

    def record(self, op: str, args: dict[str, Any]) -> None:
        dt = OPS[op].dtype_of(args)
        rec = self.seen.setdefault((op, dt), Needed(op, dt))
        rec.calls += 1
        rec.during.add(self.phase)
        kind = cache_kind(args) if isinstance(args.get("layout"), SeqLayout) else None
        if kind is not None:  # ragged / paged, or the FP8 rows and split pools a cache holds (SPEC 7.9)
            rec.layouts.add(kind)
        # backward is needed where the op's output carries gradients (the reference's differentiable ops)
        if (
            self.ops[op].caps.differentiable
            and torch.is_grad_enabled()
            and any(isinstance(v, torch.Tensor) and v.requires_grad for v in args.values())
        ):
            rec.backward = True


class _Record(Hook):
    """Every call the recorder's front door serves, written down (a hook: it sees the validated call)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def observe(self, backend: Any, op: str, args: dict[str, Any], out: Any) -> None:
        self.recorder.record(op, args)


def load_config(config: str):
    """A preset name (glm5/core/presets) or a config.json path."""
    from glm5.core.config import GLM5Config

    try:
        if config.endswith(".json") or Path(config).is_file():
            return GLM5Config.from_json(config)
        return GLM5Config.from_preset(config)
    except (OSError, ValueError) as exc:
        raise NeedsError(f"--config: {exc}") from None


def miniature(cfg):
    """`cfg`'s structure at the tiny preset's sizes."""
    from glm5.core.config import GLM5Config

    small = GLM5Config.from_preset(_SMALL)
    kinds = cfg.indexer_types
    pattern = "FFSF" if "shared" in kinds else "FFFF"
    grouped = cfg.n_group > 1
    return GLM5Config.from_preset(
        _SMALL,
        index_topk_pattern=pattern,
        indexer_types=None,
        n_group=2 if grouped else 1,
        topk_group=(2 if cfg.topk_group == cfg.n_group else 1) if grouped else 1,
        n_shared_experts=min(cfg.n_shared_experts, 1),
        first_k_dense_replace=min(cfg.first_k_dense_replace, 1),
        num_nextn_predict_layers=min(cfg.num_nextn_predict_layers, 1),
        num_experts_per_tok=min(cfg.num_experts_per_tok, small.num_experts_per_tok),
        tie_word_embeddings=cfg.tie_word_embeddings,
        norm_topk_prob=cfg.norm_topk_prob,
    )


def _quantize(model, recipe: str, calib_ids: torch.Tensor) -> None:
    from quant.quantize import quantize_model
    from quant.recipe import Recipe

    try:
        r = Recipe.load(recipe)
    except (OSError, ValueError) as exc:
        raise NeedsError(f"--recipe: {exc}") from None
    gs = {rule.scheme.group_size for rule in r.rules if rule.scheme.group_size}
    if gs:  # per-group int4 stays per-group, at a group size the miniature's widths divide
        r = Recipe.load(recipe, group_size=16)
    quantize_model(model, r, calib_ids=calib_ids)  # GPTQ recipes need calibration data


def derive(
    config: str = "tiny", recipes: tuple[str, ...] = (), dtype: str | None = None, train: bool = False
):
    """(list of Needed in op-table order, what was run)."""
    from glm5.core.model import GLM5ForCausalLM
    from glm5.generate import generate, generate_speculative

    cfg = load_config(config)
    dtype = dtype or ("float32" if config == "tiny" else "bfloat16")
    small = miniature(cfg)
    rec = Recorder()
    ids = torch.randint(0, small.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ran = []
    torch.manual_seed(0)
    model = GLM5ForCausalLM(small, backend=rec, dtype=DTYPES[dtype])
    for recipe in recipes:
        _quantize(model, recipe, ids)
    rec.seen.clear()  # calibration runs offline: not what serving the model needs
    model.eval().requires_grad_(False)
    steps = [
        ("generate ragged", lambda: generate(model, ids, 3)),
        ("generate paged", lambda: generate(model, ids, 3, block_size=4)),
    ]
    if small.num_nextn_predict_layers:
        steps.append(
            ("generate MTP speculative", lambda: generate_speculative(model, ids[:1], 3, num_draft=1))
        )
    for what, fn in steps:
        rec.phase = what
        fn()
        ran.append(what)
    if train:
        rec.phase = "train step"
        _train_step(model, ids)
        ran.append("train step (LM loss, DSA indexer KL loss, backward)")
    order = {op: i for i, op in enumerate(OPS)}
    needed = sorted(rec.seen.values(), key=lambda n: (order[n.op], OPS[n.op].dtype_axis.index(n.dtype)))
    return needed, {"config": config, "recipes": list(recipes), "dtype": dtype, "train": train, "ran": ran}


def _train_step(model, ids: torch.Tensor) -> None:
    from glm5.train.loop.dsa import AttentionProbe

    model.train().requires_grad_(True)
    probe = AttentionProbe(model, stage="sparse", track_max_logit=False)
    try:
        out = model(ids, labels=ids, return_logits=False)
        loss = out.loss
        kl = probe.kl_loss()
        if kl is not None:
            loss = loss + kl
        loss.backward()
    finally:
        probe.remove()
        model.eval().requires_grad_(False)

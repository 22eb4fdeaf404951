"""What both checkpoint formats share: walking a quantized model's float and integer weights under their
Hugging Face names, writing and reading safetensors shards, and filling a model back from tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm5.core.checkpoint import FLOAT_DTYPES, TensorFiles, fit_report, hf_names, write_shards
from quant.apply import EXPERT_PROJS
from quant.modules import QuantExperts, QuantLinear
from quant.recipe import Scheme

INDEX_FILE = "model.safetensors.index.json"


QuantEntry = tuple[str, Scheme, Callable[[], tuple], nn.Module, "int | None"]
#: which module names a writer covers (None: all): a streamed conversion writes one layer at a time
Scope = Callable[[str], bool] | None


def within(prefix: str) -> Callable[[str], bool]:
    """The scope of one submodule: `within("model.layers.3")`."""
    return lambda name: name.startswith(prefix + ".")


def quantized_modules(model: nn.Module, scope: Scope = None) -> Iterator[QuantEntry]:
    """(HF module name, scheme, get() -> (q int8 [N, K], scale fp32 [N, G], bias or None), module, expert)."""
    for name, mod in model.named_modules():
        if scope is not None and not scope(name):
            continue
        if isinstance(mod, QuantLinear):
            yield name, mod.scheme, (lambda m=mod: (*m.int_weight(), m.bias)), mod, None
        elif isinstance(mod, QuantExperts):
            for e in range(mod.n_experts):
                for p in EXPERT_PROJS:
                    yield f"{name}.{e}.{p}", mod.scheme, _expert_getter(mod, e, p), mod, e


def _expert_getter(mod: QuantExperts, e: int, p: str) -> Callable[[], tuple]:
    return lambda: (*mod.int_weight(e, p), None)


def float_entries(model: nn.Module, scope: Scope = None) -> Iterator[tuple[str, str, int | None]]:
    """(checkpoint name, state_dict name, expert index) of every float tensor (quantized modules excluded)
    in `scope` (a predicate on the owning module's name)."""
    qprefix = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts)))
    for hf, name, e in hf_names(model):
        if name.startswith(qprefix) or (scope is not None and not scope(name.rsplit(".", 1)[0])):
            continue
        yield hf, name, e


def float_tensors(model: nn.Module, scope: Scope = None) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {
        hf: (sd[n][e] if e is not None else sd[n]).detach().cpu().contiguous().clone()
        for hf, n, e in float_entries(model, scope)
    }


def write_checkpoint(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    extra_files: dict[str, Any] | None = None,
    max_shard_size: int = 5 << 30,
) -> None:
    """config.json + safetensors (+ extra JSON files), atomically (glm5.core.checkpoint.ShardWriter)."""
    write_shards(path, config, tensors, max_shard_size, extra_files)


class TensorReader(TensorFiles):
    """All tensors of a checkpoint directory by name, read as the float loader reads them (only regular
    files inside `path`; every tensor checked: glm5.core.checkpoint.TensorFiles); records which were read (for
    strict loading)."""

    def __init__(self, path: Path) -> None:
        super().__init__(Path(path), INDEX_FILE)
        self.used: set[str] = set()

    def get(self, name: str, dtypes: Any = None) -> torch.Tensor:
        t = super().get(name, dtypes)
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.used)

    def fit(self, model: nn.Module, copies: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
        """(missing, unexpected, mis-shaped) tensors against a float checkpoint of `model`
        (glm5.core.checkpoint.fit_report); reads headers only."""
        return fit_report(model, self.where, self.shape, copies)


@torch.no_grad()
def fill_model(
    model: nn.Module,
    reader: TensorReader,
    decode: Callable[[str, Scheme, TensorReader], tuple[torch.Tensor, torch.Tensor, Any]],
    ignore: Callable[[str], bool] = lambda n: False,
) -> None:
    """Fill a model whose quantized modules are already swapped in: float tensors by name, quantized ones
    through `decode(module name, scheme, reader) -> (q int8 [N, K], scale [N, G], bias or None)`.
    Every tensor of the checkpoint must be used (except names `ignore` accepts)."""
    sd = model.state_dict(keep_vars=True)
    for hf, name, e in float_entries(model):
        t = reader.get(hf, FLOAT_DTYPES)
        dst = sd[name][e] if e is not None else sd[name]
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint: {hf} expected shape {list(dst.shape)}, got {list(t.shape)}")
        dst.copy_(t)
    for name, scheme, _, mod, e in quantized_modules(model):
        q, scale, bias = decode(name, scheme, reader)
        if e is None:
            want = (mod.out_features, mod.in_features)
            want_scale = tuple(mod.weight_scale.reshape(mod.out_features, -1).shape)
        else:
            proj = name.rsplit(".", 1)[1]
            want, want_scale = (tuple(t.shape) for t in mod.int_weight(e, proj))
        # a copy would broadcast a [1, 1] scale or a [1] bias over the whole weight: refuse by name
        checks = [("weight", q, want), ("weight_scale", scale, want_scale)]
        if bias is not None:
            checks.append(("bias", bias, (mod.out_features,)))
        for what, t, shape in checks:
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"checkpoint: {name} expected {what} shape {list(shape)}, got {list(t.shape)}"
                )
        if e is None:
            mod.set_int(q, scale, bias)
        else:
            mod.set_int(e, proj, q, scale)
    left = [n for n in reader.unused() if not ignore(n)]
    if left:
        raise ValueError(f"checkpoint: {len(left)} unexpected tensor(s): {', '.join(left[:20])}")
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

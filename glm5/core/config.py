"""`GLM5Config`: the Hugging Face `glm_moe_dsa` config as one dataclass (SPEC 5).

Field names are the published ones, so `config.json` loads with `GLM5Config.from_dict` and
`to_dict` writes a file Hugging Face tools read back. Presets live in `glm5/core/presets/<name>.yaml`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).parent / "presets"
MODEL_TYPE = "glm_moe_dsa"


@dataclass
class GLM5Config:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    # eps of q_a_layernorm / kv_a_layernorm; None = rms_norm_eps (vLLM, SGLang, Megatron). transformers
    # hard-codes 1e-6 there: set 1e-6 to reproduce it (docs/model.md)
    lora_norm_eps: float | None = None
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 1e6, "rope_type": "default"})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # mla
    q_lora_rank: int | None = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    # dsa
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    indexer_rope_interleave: bool = True
    indexer_types: list[str] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | list[str] | None = None
    # moe
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    # mtp
    num_nextn_predict_layers: int = 1

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.indexer_types is None:
            self.indexer_types = _derive_indexer_types(self)
        self.validate()

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 1e6))

    @property
    def lora_eps(self) -> float:
        """The eps q_a_layernorm and kv_a_layernorm use."""
        return self.rms_norm_eps if self.lora_norm_eps is None else float(self.lora_norm_eps)

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the attention: qk_head_dim ** -0.5 (0.0625 for GLM-5), not 576 ** -0.5."""
        return self.qk_head_dim**-0.5

    def is_moe_layer(self, i: int) -> bool:
        """Layers from first_k_dense_replace on (the MTP layers included) have a MoE MLP."""
        return i >= self.first_k_dense_replace

    def validate(self) -> None:
        def bad(name: str, want: str, got: Any) -> None:
            raise ValueError(f"{name}: expected {want}, got {_short(got)}")

        if self.rope_parameters.get("rope_type", "default") != "default":
            bad(
                "rope_parameters.rope_type",
                "'default' (GLM-5 uses no YaRN)",
                self.rope_parameters.get("rope_type"),
            )
        if self.lora_norm_eps is not None and not (
            isinstance(self.lora_norm_eps, (int, float)) and 0 < self.lora_norm_eps < 1
        ):
            bad("lora_norm_eps", "None (= rms_norm_eps) or a number in (0, 1)", self.lora_norm_eps)
        if self.scoring_func != "sigmoid":
            bad("scoring_func", "'sigmoid'", self.scoring_func)
        if self.hidden_act != "silu":
            bad("hidden_act", "'silu'", self.hidden_act)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            bad(
                "qk_rope_head_dim", f"even and <= index_head_dim={self.index_head_dim}", self.qk_rope_head_dim
            )
        if len(self.indexer_types) != self.num_hidden_layers:
            bad("indexer_types", f"{self.num_hidden_layers} entries (one per layer)", len(self.indexer_types))
        if any(t not in ("full", "shared") for t in self.indexer_types):
            bad("indexer_types", "entries 'full' or 'shared'", self.indexer_types)
        if self.indexer_types and self.indexer_types[0] != "full":
            bad(
                "indexer_types",
                "layer 0 'full' (a shared layer reuses an earlier full layer)",
                self.indexer_types[0],
            )
        if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            bad(
                "n_group/topk_group",
                f"n_group dividing n_routed_experts={self.n_routed_experts}, 1 <= topk_group <= n_group",
                (self.n_group, self.topk_group),
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            bad(
                "num_experts_per_tok",
                f"<= n_routed_experts={self.n_routed_experts}",
                self.num_experts_per_tok,
            )
        if self.num_nextn_predict_layers > self.num_hidden_layers:
            bad(
                "num_nextn_predict_layers",
                f"<= num_hidden_layers={self.num_hidden_layers}",
                self.num_nextn_predict_layers,
            )
        theta = self.rope_parameters.get("rope_theta", 1e6)
        if not _is(theta, float) or not theta > 0:
            bad("rope_parameters.rope_theta", "a number > 0", theta)

    # -- I/O ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GLM5Config:
        """From a Hugging Face config dict; unknown keys (dtype, architectures, ...) are ignored."""
        mt = d.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {mt!r}")
        d = dict(d)
        if "rope_parameters" not in d and "rope_theta" in d:  # transformers < 5 spelling
            d["rope_parameters"] = {
                "rope_theta": d["rope_theta"],
                "rope_type": "default",
                **(d.get("rope_scaling") or {}),
            }
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(model_type=MODEL_TYPE, architectures=["GlmMoeDsaForCausalLM"], qk_head_dim=self.qk_head_dim)
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> GLM5Config:
        """From a config.json; an unreadable file, one that is not a JSON object, or a bad field is one
        ValueError line naming the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError(
                    f"expected a JSON object (a Hugging Face config.json), got a JSON {type(data).__name__}"
                )
            return cls.from_dict(data)
        except OSError as exc:
            raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a bad field
            raise ValueError(f"{path}: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GLM5Config:
        """A preset from glm5/core/presets/<name>.yaml (yaml.safe_load), with field overrides."""
        path = PRESET_DIR / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ValueError(f"preset: expected one of {known}, got {name!r}")
        d = yaml.safe_load(path.read_text()) or {}
        d.update(overrides)
        if overrides.get("num_hidden_layers") is not None and "indexer_types" not in overrides:
            d.pop("indexer_types", None)  # re-derive for the new depth
        return cls.from_dict(d)


#: inclusive (low, high) bounds of numeric fields (each entry of a list field); the types come from the
#: field annotations (bool is not an int, 64.0 is not an int)
_RANGES: dict[str, tuple[float, float]] = {
    **{
        f: (1, math.inf)
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "index_topk",
            "index_n_heads",
            "index_head_dim",
            "index_topk_freq",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_group",
            "topk_group",
        )
    },
    **{
        f: (0, math.inf)
        for f in (
            "n_shared_experts",
            "first_k_dense_replace",
            "index_skip_topk_offset",
            "num_nextn_predict_layers",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "initializer_range",
        )
    },
}
#: bounds whose low end is excluded (an eps, a scale)
_OPEN_LOW: dict[str, tuple[float, float]] = {"rms_norm_eps": (0, 1), "routed_scaling_factor": (0, math.inf)}
_NON_EMPTY = {"eos_token_id", "rope_parameters"}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is(value: Any, tp: Any) -> bool:
    """`value` fits the annotation `tp` (int, float, bool, str, dict, list[X], unions, None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, arm) for arm in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, origin or tp)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__


def _check_fields(c: GLM5Config) -> None:
    """Every field of the type its annotation says and in its range (_RANGES): ValueError naming the
    field, what was expected and what it got (long values cut short)."""
    hints = typing.get_type_hints(type(c))
    for f in dataclasses.fields(c):
        value, tp = getattr(c, f.name), hints[f.name]
        if not _is(value, tp):
            raise ValueError(f"{f.name}: expected {_type_name(tp)}, got {_short(value)}")
        if f.name in _NON_EMPTY and isinstance(value, (list, dict)) and not value:
            raise ValueError(f"{f.name}: expected a non-empty {type(value).__name__}, got {_short(value)}")
        lo, hi = _OPEN_LOW.get(f.name) or _RANGES.get(f.name, (-math.inf, math.inf))
        is_open = f.name in _OPEN_LOW
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, (int, float)) and not ((lo < v if is_open else lo <= v) and v <= hi):
                want = f"{'>' if is_open else '>='} {lo}" + (f" and <= {hi}" if hi != math.inf else "")
                raise ValueError(f"{f.name}: expected {want}, got {_short(value)}")


def _derive_indexer_types(c: GLM5Config) -> list[str]:
    """Explicit `indexer_types`, else `index_topk_pattern` ("F"/"S" per layer), else every
    `index_topk_freq`-th layer counted from `index_skip_topk_offset` is full (freq 1: all full)."""
    n = c.num_hidden_layers
    if c.index_topk_pattern is not None:
        p = c.index_topk_pattern
        table = {"F": "full", "S": "shared", "full": "full", "shared": "shared"}
        try:
            return [table[x] for x in p]
        except KeyError as exc:
            raise ValueError(f"index_topk_pattern: expected 'F'/'S' per layer, got {p!r}") from exc
    freq = max(int(c.index_topk_freq or 1), 1)
    off = int(c.index_skip_topk_offset)
    return ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]

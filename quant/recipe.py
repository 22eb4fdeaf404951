"""Recipes: which linear weights get which scheme, as YAML in quant/recipes/<name>.yaml.

A rule names a scheme and fnmatch patterns over Hugging Face module names (`model.layers.3.self_attn.
q_a_proj`, `model.layers.5.mlp.experts.17.down_proj`); `{mtp}` expands to each MTP layer index. A
module matched by no rule stays FLOAT; one matched by two rules is an error (the recipe must say which).
`keep_float` lists patterns that must stay FLOAT whatever the rules say: assigning a scheme to one of
them is an error, so the kept-in-bf16 list of the GLM-5 recipe is enforced, not just hoped for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

RECIPE_DIR = Path(__file__).parent / "recipes"
FLOAT = "FLOAT"
W8A8 = "W8A8_DYNAMIC"
W4A8 = "W4A8_DYNAMIC"
SCHEMES = (W8A8, W4A8)


@dataclass(frozen=True)
class Scheme:
    """How one linear weight is stored and computed. group_size 0: per output channel."""

    name: str  # W8A8_DYNAMIC | W4A8_DYNAMIC
    group_size: int = 0

    @property
    def bits(self) -> int:
        return 4 if self.name == W4A8 else 8


@dataclass(frozen=True)
class Rule:
    name: str
    scheme: Scheme
    targets: tuple[str, ...]
    exclude: tuple[str, ...] = ()


@dataclass
class Recipe:
    name: str
    rules: list[Rule]
    keep_float: tuple[str, ...] = ()
    convention: str = "qmax"
    calibration: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | Path, group_size: int | None = None) -> Recipe:
        """A recipe by name (quant/recipes/<name>.yaml) or path; group_size overrides every int4 rule."""
        p = Path(name_or_path)
        if not p.suffix:
            p = RECIPE_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            known = sorted(q.stem for q in RECIPE_DIR.glob("*.yaml"))
            raise ValueError(f"recipe: expected one of {known} or a YAML path, got {str(name_or_path)!r}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"recipe: {p} is not a readable YAML file ({first})") from None
        return cls.from_dict(data or {}, group_size)

    @classmethod
    def from_dict(cls, d: Any, group_size: int | None = None) -> Recipe:
        """A recipe from its parsed YAML; every field of the wrong type or value is a ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"recipe: expected a YAML mapping (name, rules, ...), got {_kind(d)}")
        rules = []
        for i, r in enumerate(_list(d, "rules", dict, "a mapping (name, scheme, targets, exclude)")):
            scheme = r.get("scheme")
            if scheme not in SCHEMES:
                raise ValueError(f"rules[{i}].scheme: expected one of {list(SCHEMES)}, got {scheme!r}")
            gs = r.get("group_size", 0)
            if isinstance(gs, bool) or not isinstance(gs, int) or gs < 0:
                raise ValueError(f"rules[{i}].group_size: expected an int >= 0, got {gs!r}")
            if scheme == W4A8 and group_size is not None:
                gs = group_size
            if scheme == W8A8 and gs:
                raise ValueError(f"rules[{i}].group_size: W8A8_DYNAMIC is per channel (0), got {gs}")
            targets = tuple(_list(r, "targets", str, "a pattern string", f"rules[{i}]."))
            if not targets:
                raise ValueError(f"rules[{i}].targets: expected at least one pattern, got {targets!r}")
            exclude = tuple(_list(r, "exclude", str, "a pattern string", f"rules[{i}]."))
            name = r.get("name", f"rule{i}")
            if not isinstance(name, str):
                raise ValueError(f"rules[{i}].name: expected a string, got {name!r}")
            rules.append(Rule(name, Scheme(scheme, gs), targets, exclude))
        conv = d.get("convention", "qmax")
        if conv not in ("qmax", "half_range"):
            raise ValueError(f"convention: expected 'qmax' or 'half_range', got {conv!r}")
        calibration = d.get("calibration") or {}
        if not isinstance(calibration, dict):
            raise ValueError(f"calibration: expected a mapping, got {_kind(calibration)}")
        name, description = d.get("name", "?"), d.get("description", "")
        for field_name, value in (("name", name), ("description", description)):
            if not isinstance(value, str):
                raise ValueError(f"{field_name}: expected a string, got {value!r}")
        keep = tuple(_list(d, "keep_float", str, "a pattern string"))
        return cls(name, rules, keep, conv, dict(calibration), description)

    # -- assignment ------------------------------------------------------------------------------
    def scheme_for(self, module: str, mtp_layers: list[int]) -> Scheme | None:
        """The scheme of one module name (None: FLOAT). Raises ValueError on ambiguity or a kept module."""
        hits = [
            r
            for r in self.rules
            if _match(module, r.targets, mtp_layers) and not _match(module, r.exclude, mtp_layers)
        ]
        if len(hits) > 1:
            raise ValueError(
                f"recipe {self.name}: module {module} matches rules "
                f"{[r.name for r in hits]}; a module needs exactly one scheme"
            )
        if hits and _match(module, self.keep_float, mtp_layers):
            raise ValueError(
                f"recipe {self.name}: module {module} is in keep_float but rule "
                f"{hits[0].name} assigns {hits[0].scheme.name}"
            )
        return hits[0].scheme if hits else None

    def plan(self, modules: list[str], mtp_layers: list[int]) -> dict[str, Scheme]:
        """module name -> scheme for every quantized module among `modules` (the rest are FLOAT)."""
        out = {}
        for m in modules:
            s = self.scheme_for(m, mtp_layers)
            if s is not None:
                out[m] = s
        return out


def _match(name: str, patterns: tuple[str, ...], mtp_layers: list[int]) -> bool:
    for p in patterns:
        expanded = [p.replace("{mtp}", str(i)) for i in mtp_layers] if "{mtp}" in p else [p]
        if any(fnmatchcase(name, e) for e in expanded):
            return True
    return False


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _list(d: dict, key: str, item: type, what: str, where: str = "") -> list:
    """d[key] as a list whose items are all `item` (absent or null: []); ValueError naming the field."""
    value = d.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{where}{key}: expected a list, got {_kind(value)}")
    for j, v in enumerate(value):
        if not isinstance(v, item):
            raise ValueError(f"{where}{key}[{j}]: expected {what}, got {_kind(v)}")
    return value


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))

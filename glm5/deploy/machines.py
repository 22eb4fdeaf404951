"""Machine profiles: one YAML file per node type in glm5/machines/ (devices, memory per device, links,
the serving engine and its defaults, kernel limits), so a new chip or node type is a new file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MACHINE_DIR = Path(__file__).resolve().parent.parent / "machines"
CACHE_FORMATS = ("bf16", "fp8")
_UNITS = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_bytes(text: str | int, name: str) -> int:
    """'64 GiB' / '143771 MiB' / '141 GB' / an int of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)\s*", str(text))
    if not m:
        raise ValueError(f"{name}: expected a size like '64 GiB' or '143771 MiB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    vendor: str
    devices_per_node: int
    memory_per_device: int  # bytes
    links: dict[str, str]
    engine: dict[str, Any]
    caches: dict[str, Any]
    limits: dict[str, Any] = field(default_factory=dict)

    # -- engine defaults -------------------------------------------------------------------------
    @property
    def engine_name(self) -> str:
        return str(self.engine["name"])

    @property
    def checkpoint_format(self) -> str:
        return str(self.engine["checkpoint_format"])

    @property
    def default_recipe(self) -> str:
        """The recipe `glm5 plan` plans without --recipe: one this machine's engine serves."""
        return str(self.engine.get("default_recipe", "glm5-w4a8"))

    @property
    def gpu_memory_utilization(self) -> float:
        return float(self.engine.get("gpu_memory_utilization", 0.9))

    @property
    def kv_block_size(self) -> int:
        return int(self.engine.get("kv_block_size", 1))

    @property
    def comm_buffer_bytes(self) -> int:
        return int(float(self.engine.get("runtime", {}).get("comm_buffer_mib", 0)) * (1 << 20))

    @property
    def reserve_bytes(self) -> int:
        return int(float(self.engine.get("runtime", {}).get("reserve_gib", 0)) * (1 << 30))

    def env(self, recipe: str) -> dict[str, str]:
        out = {str(k): str(v) for k, v in (self.engine.get("env") or {}).items()}
        out.update(
            {str(k): str(v) for k, v in ((self.engine.get("env_by_recipe") or {}).get(recipe) or {}).items()}
        )
        return out

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | Path) -> Machine:
        """A profile by name (glm5/machines/<name>.yaml) or by path to a YAML file."""
        p = Path(name_or_path)
        if p.suffix not in (".yaml", ".yml"):
            p = MACHINE_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ValueError(
                f"machine: expected one of {available()} or a YAML path, got {str(name_or_path)!r}"
            )
        return cls.from_dict(yaml.safe_load(p.read_text()) or {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Machine:
        for key in ("name", "devices_per_node", "memory_per_device", "engine", "caches"):
            if key not in d:
                raise ValueError(f"machine.{key}: required, missing")
        n = d["devices_per_node"]
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"machine.devices_per_node: expected an int >= 1, got {n!r}")
        engine = dict(d["engine"])
        for key in ("name", "command", "checkpoint_format"):
            if key not in engine:
                raise ValueError(f"machine.engine.{key}: required, missing")
        util = float(engine.get("gpu_memory_utilization", 0.9))
        if not 0 < util <= 1:
            raise ValueError(f"machine.engine.gpu_memory_utilization: expected in (0, 1], got {util}")
        caches = dict(d["caches"])
        for kind in ("kv_cache", "indexer_cache"):
            formats = caches.get(kind) or []
            bad = [f for f in formats if f not in CACHE_FORMATS]
            if not formats or bad:
                raise ValueError(
                    f"machine.caches.{kind}: expected a list from {list(CACHE_FORMATS)}, got {formats!r}"
                )
            default = (caches.get("default") or {}).get(kind)
            if default not in formats:
                raise ValueError(f"machine.caches.default.{kind}: expected one of {formats}, got {default!r}")
        return cls(
            str(d["name"]),
            str(d.get("description", d["name"])),
            str(d.get("vendor", "")),
            n,
            parse_bytes(d["memory_per_device"], "machine.memory_per_device"),
            {str(k): str(v) for k, v in (d.get("links") or {}).items()},
            engine,
            caches,
            dict(d.get("limits") or {}),
        )


def available() -> list[str]:
    return sorted(p.stem for p in MACHINE_DIR.glob("*.yaml"))

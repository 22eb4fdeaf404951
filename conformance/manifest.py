"""A backend's expectations manifest: strict xfails, skips and tolerance overrides, each with a reason.

    # backends/<name>/expectations.yaml (yaml.safe_load)
    expectations:
      - match: "topk/bfloat16/adversarial/*"      # glob over "op/dtype/suite/case"
        status: xfail                            # xfail (strict: an unexpected pass is XPASS) | skip
        reason: "..."                             # required
        when: {interpreter: "true"}               # optional; matched against backend.environment()
    tolerances:
      - match: "sparse_mla_attention/bfloat16/*"
        output: out                              # optional: one output (or "grad:<arg>"); default all
        atol: 1.0e-3                             # any of atol, rtol, global_max, ulps,
                                                 # near_tie_rtol, near_tie_atol (indexer_topk)
        reason: "..."                             # required

Entries that match no case of a run are reported as unused, so stale loosenings do not linger.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

STATUSES = ("xfail", "skip")
TOL_KEYS = ("atol", "rtol", "global_max", "ulps", "near_tie_rtol", "near_tie_atol")


class ManifestError(ValueError):
    """A malformed expectations manifest (names the file, the entry and the field)."""


@dataclass
class Entry:
    kind: str  # "expectation" or "tolerance"
    match: str
    reason: str
    status: str | None = None
    when: dict[str, str] = field(default_factory=dict)
    output: str | None = None
    params: dict[str, float] = field(default_factory=dict)
    used: int = 0

    def applies(self, key: str, environment: Mapping[str, str]) -> bool:
        if not fnmatch.fnmatchcase(key, self.match):
            return False
        return all(str(environment.get(k)) == v for k, v in self.when.items())

    def describe(self) -> str:
        what = (
            self.status
            if self.kind == "expectation"
            else "tolerance " + ", ".join(f"{k}={v:g}" for k, v in self.params.items())
        )
        when = f" when {self.when}" if self.when else ""
        return f"{what} {self.match!r}{when}: {self.reason}"


@dataclass
class Manifest:
    path: str | None = None
    entries: list[Entry] = field(default_factory=list)

    def expectation(self, key: str, environment: Mapping[str, str]) -> Entry | None:
        """The first xfail/skip entry that applies to `key` (marked used)."""
        for e in self.entries:
            if e.kind == "expectation" and e.applies(key, environment):
                e.used += 1
                return e
        return None

    def tolerances(
        self, key: str, output: str, environment: Mapping[str, str]
    ) -> tuple[dict[str, float], list[str]]:
        """Comparator parameter overrides for one output of one case, and the reasons given."""
        params: dict[str, float] = {}
        reasons: list[str] = []
        for e in self.entries:
            if e.kind == "tolerance" and e.applies(key, environment) and e.output in (None, output):
                e.used += 1
                params |= e.params
                reasons.append(e.reason)
        return params, reasons

    def unused(self) -> list[Entry]:
        return [e for e in self.entries if e.used == 0]


def _err(path: str, i: int, section: str, msg: str) -> ManifestError:
    return ManifestError(f"{path}: {section}[{i}]: {msg}")


def parse(data: Any, path: str = "<manifest>") -> Manifest:
    """Validate a safe_load-ed manifest. Every entry needs `match` and a non-empty `reason`."""
    if data is None:
        return Manifest(path)
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path}: expected a mapping with 'expectations' and/or 'tolerances', got {type(data).__name__}"
        )
    unknown = set(data) - {"expectations", "tolerances"}
    if unknown:
        raise ManifestError(f"{path}: unknown top-level keys {sorted(unknown)}")
    out = Manifest(path)
    for section, kind in (("expectations", "expectation"), ("tolerances", "tolerance")):
        items = data.get(section) or []
        if not isinstance(items, list):
            raise ManifestError(f"{path}: {section}: expected a list, got {type(items).__name__}")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _err(path, i, section, f"expected a mapping, got {type(item).__name__}")
            allowed = {"match", "reason", "when"} | (
                {"status"} if kind == "expectation" else {"output", *TOL_KEYS}
            )
            extra = set(item) - allowed
            if extra:
                raise _err(path, i, section, f"unknown keys {sorted(extra)} (allowed: {sorted(allowed)})")
            match, reason = item.get("match"), item.get("reason")
            if not isinstance(match, str) or not match:
                raise _err(path, i, section, "match: a non-empty glob over 'op/dtype/suite/case' is required")
            if not isinstance(reason, str) or not reason.strip():
                raise _err(path, i, section, f"reason: required (why {match!r} is expected to differ)")
            when = item.get("when") or {}
            if not isinstance(when, dict):
                raise _err(path, i, section, f"when: expected a mapping of environment keys, got {when!r}")
            e = Entry(
                kind,
                match,
                reason.strip(),
                when={str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in when.items()},
            )
            if kind == "expectation":
                if item.get("status") not in STATUSES:
                    raise _err(
                        path, i, section, f"status: expected one of {STATUSES}, got {item.get('status')!r}"
                    )
                e.status = item["status"]
            else:
                e.output = item.get("output")
                for k in TOL_KEYS:
                    if k in item:
                        v = item[k]
                        # NaN compares false with everything: a NaN bound would pass every comparison
                        if (
                            isinstance(v, bool)
                            or not isinstance(v, (int, float))
                            or not math.isfinite(v)
                            or v < 0
                        ):
                            raise _err(
                                path, i, section, f"{k}: expected a finite non-negative number, got {v!r}"
                            )
                        e.params[k] = float(v)
                if not e.params:
                    raise _err(path, i, section, f"give at least one of {TOL_KEYS}")
            out.entries.append(e)
    return out


def load(path: str | Path | None) -> Manifest:
    """Read a manifest file; a missing file is an empty manifest."""
    if path is None or not Path(path).is_file():
        return Manifest(None if path is None else str(path))
    with open(path, encoding="utf-8") as f:
        return parse(yaml.safe_load(f), str(path))

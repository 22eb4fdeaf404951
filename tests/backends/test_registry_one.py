"""The registry builds only the backend asked for, and a plugin's name is its own: one that collides
with a built-in or with another plugin is refused with both sources named, never silently dropped or
silently chosen (SPEC 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import backends
from backends import Backend, BackendUnavailable, registry

_OTHERS = ("backends.cuda", "backends.ascend", "backends.onnxruntime", "torch_npu", "onnxruntime")


@pytest.fixture(autouse=True)
def fresh_registry():
    backends.refresh()
    yield
    backends.refresh()


def test_get_cpu_in_a_fresh_process_imports_no_other_backend():
    repo = Path(__file__).resolve().parents[2]
    code = f"import sys, backends; backends.get('cpu'); print([m for m in {_OTHERS!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class _Widget(Backend):
    name = "widget"

    def available(self):
        return True, "widget here"


class _Reference(Backend):
    name = "reference"

    def available(self):
        return True, "an impostor"


@dataclass
class _Dist:
    name: str


@dataclass
class _FakeEntryPoint:
    """The part of importlib.metadata.EntryPoint the registry reads."""

    name: str
    value: str
    dist: _Dist
    target: type

    def load(self) -> type:
        return self.target


def _install(monkeypatch, *eps: _FakeEntryPoint) -> None:
    monkeypatch.setattr(registry, "_plugin_entry_points", lambda: list(eps))


def test_two_plugins_with_one_name_are_refused_naming_both(monkeypatch):
    _install(
        monkeypatch,
        _FakeEntryPoint("widget", "acme_widget:Widget", _Dist("acme-widget"), _Widget),
        _FakeEntryPoint("widget", "other_widget:Widget", _Dist("other-widget"), _Widget),
    )
    with pytest.raises(BackendUnavailable) as e:
        backends.get("widget")
    msg = str(e.value)
    assert "more than one plugin claims this name" in msg
    assert (
        "plugin acme-widget (acme_widget:Widget)" in msg
        and "plugin other-widget (other_widget:Widget)" in msg
    )
    rows = {name: (ok, reason) for name, ok, reason in backends.available()}
    assert rows["widget"][0] is False and "other-widget" in rows["widget"][1]


def test_one_plugin_of_a_name_still_loads(monkeypatch):
    _install(monkeypatch, _FakeEntryPoint("widget", "acme_widget:Widget", _Dist("acme-widget"), _Widget))
    assert backends.get("widget").name == "widget"


def test_a_plugin_taking_a_builtin_name_is_listed_as_refused(monkeypatch):
    _install(monkeypatch, _FakeEntryPoint("reference", "acme_ref:Ref", _Dist("acme-ref"), _Reference))
    assert (
        type(backends.get("reference")).__module__ == "backends.reference.backend"
    )  # the built-in keeps its name
    refused = [(n, ok, r) for n, ok, r in backends.available() if "acme-ref" in n or "acme-ref" in r]
    assert len(refused) == 1
    name, ok, reason = refused[0]
    assert ok is False and name == "reference [plugin acme-ref (acme_ref:Ref)]"
    assert "refused" in reason and "backends.reference:ReferenceBackend" in reason
    assert registry.loaded(name) is None and "reference" in backends.names()

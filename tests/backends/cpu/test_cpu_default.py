"""`glm5 generate` runs on the cpu backend unless --backend or $GLM5_BACKEND says otherwise, and gives
the reference's greedy tokens; the library default stays the reference."""

from __future__ import annotations

import json

from click.testing import CliRunner

import backends
from glm5.cli import main


def _generate(monkeypatch, *extra: str) -> dict:
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    args = ["generate", "--preset", "tiny", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "3", "--json"]
    r = CliRunner().invoke(main, args + list(extra))
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_generate_defaults_to_cpu(monkeypatch):
    got = _generate(monkeypatch)
    want = _generate(monkeypatch, "--backend", "reference")
    assert got["backend"] == "cpu" and want["backend"] == "reference"
    assert got["tokens"] == want["tokens"]


def test_library_default_is_the_reference(monkeypatch):
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    assert backends.get().name == "reference"

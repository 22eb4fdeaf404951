"""The registry builds each backend once, also when several threads ask for it at first use (SPEC 6:
`backends.get(name)` is the backend; its call counters and prepared state must not split)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import backends
from backends import registry

THREADS = 8


@pytest.fixture(autouse=True)
def fresh_registry():
    backends.refresh()
    yield
    backends.refresh()


def _get_from_threads(name: str) -> list[object]:
    barrier = threading.Barrier(THREADS)
    got: list[object] = [None] * THREADS
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            got[i] = backends.get(name)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return got


def test_first_use_from_eight_threads_builds_one_instance(monkeypatch):
    # a constructor that takes a while (as the onnxruntime backend's does at first use) widens the
    # window in which unsynchronised first uses each build their own instance
    built: list[str] = []
    load = registry._load_builtin

    def slow_load(name: str):
        built.append(name)
        time.sleep(0.02)
        return load(name)

    monkeypatch.setattr(registry, "_load_builtin", slow_load)
    got = _get_from_threads("reference")
    assert len({id(b) for b in got}) == 1
    assert built.count("reference") == 1
    assert got[0] is backends.get("reference")


_FIRST_USE = """
import threading, backends
barrier, got = threading.Barrier(8), []
def worker():
    barrier.wait()
    got.append(backends.get("onnxruntime"))
threads = [threading.Thread(target=worker) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(len({id(b) for b in got}), len(got))
"""


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")),
    reason="needs the onnx extra: runs in the onnxruntime tox env",
)
def test_onnxruntime_first_use_from_eight_threads_in_a_fresh_process_is_one_instance():
    # the race needs a first use that also imports the backend: only a fresh interpreter has one
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_USE],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", str(THREADS)]


def test_get_builds_only_the_backend_it_names():
    """`get("cpu")` must not build the others (building `ascend` on an Atlas host imports torch_npu)."""
    backends.get("cpu")
    assert set(registry._cache) <= {"cpu", "reference"}
    with pytest.raises(backends.BackendUnavailable, match="unknown backend 'nope'; known: reference, cpu"):
        backends.get("nope")
    assert set(registry._cache) <= {"cpu", "reference"}

"""Fixtures for the onnxruntime backend's own tests (numerical agreement on generated cases is the
conformance suite's job: `glm5 conformance --backend onnxruntime`)."""

from __future__ import annotations

import pytest

import backends
from backends.counters import REFERENCE_CALLS


@pytest.fixture(scope="session")
def be():
    return backends.get("onnxruntime")


@pytest.fixture(scope="session")
def ref():
    return backends.get("reference")


@pytest.fixture
def no_fallback(be):
    """Asserts the test body ran ONNX Runtime sessions and never the reference."""
    before_ref, before_runs = sum(REFERENCE_CALLS.values()), sum(be.kernel_calls().values())

    def check(ref_calls_allowed: int = 0) -> None:
        assert sum(be.kernel_calls().values()) > before_runs, "no ONNX Runtime session ran"
        assert sum(REFERENCE_CALLS.values()) - before_ref == ref_calls_allowed

    return check

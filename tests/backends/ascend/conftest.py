"""Ascend backend tests run in the `ascend-interpret` tox env: triton-ascend's interpreter for the kernels
(TRITON_INTERPRET=1, set before any kernel module is imported) and the documented-operator CPU
emulations (GLM5_ASCEND_EMULATE=1, an explicit mode the backend reports). torch_npu is never installed."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton.backends.ascend") is None:
    pytest.skip("triton-ascend is not installed (run: tox -e ascend-interpret)", allow_module_level=True)


@pytest.fixture
def make_backend(monkeypatch):
    """Build an AscendBackend in emulation mode with a given SoC's operator limits."""

    def make(soc: str = "A3"):
        from backends.ascend import AscendBackend

        monkeypatch.setenv("GLM5_ASCEND_EMULATE", "1")
        monkeypatch.setenv("GLM5_ASCEND_SOC", soc)
        be = AscendBackend()
        ok, why = be.available()
        assert ok, why
        return be

    return make


@pytest.fixture
def backend(make_backend):
    return make_backend("A3")


@pytest.fixture
def reference():
    from backends.reference import ReferenceBackend

    return ReferenceBackend()

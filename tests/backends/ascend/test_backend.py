"""Availability, provenance and the explicit emulation mode."""

from __future__ import annotations

import torch

from backends.ascend import _provider


def test_without_torch_npu_the_backend_is_unavailable_with_the_true_reason():
    res = _provider.resolve(env={})
    assert res.provider is None
    assert "torch_npu is not installed" in res.reason
    assert "GLM5_ASCEND_EMULATE=1" in res.reason


def test_emulation_is_reported_as_emulation(backend):
    ok, why = backend.available()
    assert ok and "emulated on CPU (not an NPU)" in why and "interpreter" in why
    env = backend.environment()
    assert env["emulated"] == "true" and env["mode"].startswith("emulation")
    assert "torch_npu (emulated)" in env["provenance.indexer_topk"]
    assert "triton-ascend (interpreted)" in env["provenance.topk"]


def test_emulation_without_the_interpreter_is_unavailable(backend, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    ok, why = backend.available()
    assert not ok and "TRITON_INTERPRET=1" in why


def test_unknown_soc_is_refused():
    res = _provider.resolve(env={"GLM5_ASCEND_EMULATE": "1", "GLM5_ASCEND_SOC": "910Z"})
    assert res.provider is None and "GLM5_ASCEND_SOC" in res.reason


def test_routes_and_kernel_calls_are_recorded(backend):
    before = sum(backend.kernel_calls().values())
    backend.dynamic_quant_int8(torch.randn(3, 8, dtype=torch.bfloat16))
    assert sum(backend.kernel_calls().values()) == before + 1
    assert "npu_dynamic_quant" in backend.environment()["routes"]


def test_torch_npu_that_fails_to_import_is_reported_with_its_error(monkeypatch):
    # what a CPU machine with torch_npu but no CANN gives
    def broken(name, *a, **k):
        if name == "torch_npu":
            raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
        return real_import(name, *a, **k)

    real_import = _provider.importlib.import_module
    monkeypatch.setattr(_provider.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(_provider.importlib, "import_module", broken)
    res = _provider.resolve(env={})
    assert res.provider is None
    assert "fails to import" in res.reason and "libhccl.so" in res.reason and "CANN" in res.reason

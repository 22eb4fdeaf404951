"""The conformance suite under pytest, for one backend: `GLM5_CONFORMANCE_BACKEND` (default reference).

    GLM5_CONFORMANCE_BACKEND=cuda TRITON_INTERPRET=1 pytest tests/conformance/test_backend_conformance.py

Runs smoke + adversarial + errors (the realistic GLM-5 shapes run in `glm5 conformance --suite full`).
Ids are "op/dtype/suite/case", the names expectations manifests match.
"""

from __future__ import annotations

import os

import pytest

import backends
from conformance import cases
from conformance.report import failure_text
from conformance.result import PASS, SKIPPED, UNSUPPORTED, XFAIL
from conformance.runner import Runner

SELECTION = cases.select(suite=os.environ.get("GLM5_CONFORMANCE_SUITE", "quick"))


@pytest.fixture(scope="module")
def runner() -> Runner:
    # an unavailable backend is an error here, never a silent skip of the whole suite
    return Runner(backends.get(os.environ.get("GLM5_CONFORMANCE_BACKEND", "reference")))


@pytest.mark.parametrize(("case", "dtype"), SELECTION, ids=[c.key(dt) for c, dt in SELECTION])
def test_case(runner: Runner, case, dtype: str) -> None:
    res = runner.run_case(case, dtype)
    if res.status == XFAIL:
        pytest.xfail(res.message)
    if res.status in (SKIPPED, UNSUPPORTED):
        pytest.skip(f"{res.status}: {res.message}")
    assert res.status == PASS, failure_text(res)

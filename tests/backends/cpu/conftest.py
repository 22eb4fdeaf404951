"""Fixtures of the cpu backend's tests: the backend and the reference it is checked against."""

from __future__ import annotations

import pytest

import backends


@pytest.fixture(scope="module")
def cpu():
    return backends.get("cpu")


@pytest.fixture(scope="module")
def ref():
    return backends.get("reference")

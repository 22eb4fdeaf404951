"""The front door's hooks (backends/hooks.py): observe every call, override a result after validation,
nest, and serve the FP8 rollout (quant/fp8.py)."""

from __future__ import annotations

import pytest
import torch

import backends
from backends.hooks import NOT_OVERRIDDEN, Hook, Recorder


@pytest.fixture
def be():
    return backends.get("reference")


def _x(rows: int = 3, cols: int = 5) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols).flip(-1)


class Constant(Hook):
    """Overrides `topk` with a fixed (values, indices); records the overrides it was asked for."""

    def __init__(self, fill: float) -> None:
        self.fill, self.asked = fill, []

    def override(self, backend, op, args):
        self.asked.append(op)
        if op != "topk":
            return NOT_OVERRIDDEN
        k = args["k"]
        rows = args["x"].shape[0]
        return torch.full((rows, k), self.fill), torch.zeros(rows, k, dtype=torch.int32)


def test_an_observer_sees_every_call_with_its_output(be):
    x = _x()
    want = be.topk(x, 2)
    with be.hooked(Recorder()) as rec:
        got = be.topk(x, 2)
        be.topk(x, 3)
    assert [op for op, _ in rec.calls] == ["topk", "topk"]
    assert torch.equal(rec.calls[0][1][0], want[0]) and torch.equal(rec.calls[0][1][1], want[1])
    assert torch.equal(got[1], want[1]) and rec.calls[1][1][1].shape == (3, 3)
    be.topk(x, 2)  # after the block: not hooked
    assert len(rec.calls) == 2 and be.hooks == ()


def test_an_override_replaces_the_result_and_the_implementation_does_not_run(be):
    before = be.calls["topk"]
    with be.hooked(Constant(7.0)):
        values, indices = be.topk(_x(), 2)
    assert torch.equal(values, torch.full((3, 2), 7.0)) and not indices.any()
    assert be.calls["topk"] == before


def test_bad_arguments_raise_before_the_override_runs(be):
    hook = Constant(7.0)
    with be.hooked(hook), pytest.raises(ValueError, match="k"):
        be.topk(_x(), 0)
    with be.hooked(hook), pytest.raises(ValueError, match="x"):
        be.topk(torch.zeros(4), 1)
    assert hook.asked == []


def test_nested_hooks_the_latest_override_wins_observers_in_installation_order(be):
    seen = []

    class Named(Hook):
        def __init__(self, name):
            self.name = name

        def observe(self, backend, op, args, out):
            seen.append((self.name, float(out[0][0, 0])))

    with be.hooked(Named("outer")), be.hooked(Constant(1.0)):
        with be.hooked(Constant(2.0)), be.hooked(Named("inner")):
            assert float(be.topk(_x(), 1)[0][0, 0]) == 2.0
        assert float(be.topk(_x(), 1)[0][0, 0]) == 1.0
    assert seen == [("outer", 2.0), ("inner", 2.0), ("outer", 1.0)]


def test_an_override_calling_its_own_op_reaches_the_backend_not_itself(be):
    class Doubled(Hook):
        def override(self, backend, op, args):
            if op != "topk":
                return NOT_OVERRIDDEN
            values, indices = backend.topk(**args)  # through the front door, not offered to this hook
            return values * 2, indices

    x = _x()
    with be.hooked(Recorder()) as rec, be.hooked(Doubled()):
        values, _ = be.topk(x, 2)
    assert torch.equal(values, be.topk(x, 2)[0] * 2)
    assert len(rec.outputs("topk")) == 2  # the inner call and the outer one are both observed


def test_a_view_is_hooked_alone_and_shares_the_backends_counters(be):
    view = be.with_hooks(Constant(3.0))
    assert float(view.topk(_x(), 1)[0][0, 0]) == 3.0
    before = be.calls["topk"]
    assert float(be.topk(_x(), 1)[0][0, 0]) == 4.0 and be.hooks == ()
    view.hooks = ()
    view.topk(_x(), 1)
    assert be.calls["topk"] == before + 2

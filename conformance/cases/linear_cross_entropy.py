"""Conformance cases for `linear_cross_entropy` (SPEC 2.9): the sequence-chunked output projection with a
scaled GLM-5 vocabulary, ignored targets, no counted target (NaN), large logits, gradients in h and weight.

Semantics: backends/reference/linear_cross_entropy.py (SPEC 2.9)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import randint, randn, tdtype, transposed

OUTPUTS = (Output("loss", "reduction"),)
GRADS = ("h", "weight")


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("linear_cross_entropy", id, build, **kw)
    return Case("linear_cross_entropy", id, build, OUTPUTS, grad_args=kw.pop("grad_args", GRADS), **kw)


def mk(g: torch.Generator, n, d, v, dt, *, scale=1.0, ignore=0.0, ignore_index=-100, tdt=torch.int64):
    t = randint(g, 0, v - 1, n)
    t[torch.rand(n, generator=g) < ignore] = ignore_index
    return {
        "h": randn(g, n, d, scale=scale).to(tdtype(dt)),
        "weight": randn(g, v, d, scale=d**-0.5).to(tdtype(dt)),
        "targets": t.to(tdt),
        "ignore_index": ignore_index,
    }


def _noncontig(g, dt):
    a = mk(g, 12, 24, 40, dt, ignore=0.2)
    a["weight"] = transposed(a["weight"])
    return a


def _all_ignored(g, dt):
    a = mk(g, 6, 16, 32, dt)
    a["targets"][:] = -100
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 4, 8, 16, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


CASES = [
    _case(
        "smoke/n8_d16_v32_some_ignored",
        lambda g, dt: mk(g, 8, 16, 32, dt, ignore=0.25),
        tags={"shape": "N8 D16 V32"},
    ),
    _case(
        "realistic/n48_d256_v6144",
        lambda g, dt: mk(g, 48, 256, 6144, dt, ignore=0.1),
        tags={"shape": "N48 D256 V6144"},
    ),
    _case("adversarial/large_logits", lambda g, dt: mk(g, 10, 32, 64, dt, scale=30.0)),
    _case("adversarial/all_ignored_nan_loss", _all_ignored),
    _case(
        "adversarial/ignore_index_0_int32_targets",
        lambda g, dt: mk(g, 9, 16, 24, dt, ignore=0.3, ignore_index=0, tdt=torch.int32),
    ),
    _case("adversarial/n1_v2", lambda g, dt: mk(g, 1, 8, 2, dt)),
    _case("adversarial/noncontig_transposed_weight", _noncontig, tags={"layout": "transposed"}),
    _case("adversarial/empty_n0", lambda g, dt: mk(g, 0, 8, 16, dt), trivial=True, grad_args=()),
    _case(
        "errors/targets_out_of_range",
        _bad(targets=torch.tensor([0, 1, 16, 2])),
        error=(ValueError, r"^targets: expected values in \[0, V=16\)"),
    ),
    _case(
        "errors/targets_float", _bad(targets=torch.zeros(4)), error=(ValueError, r"^targets: expected dtype")
    ),
    _case(
        "errors/weight_d_mismatch",
        _bad(weight=lambda a: a["weight"][:, :4]),
        error=(ValueError, r"^weight: expected shape"),
    ),
    _case(
        "errors/ignore_index_float",
        _bad(ignore_index=-100.0),
        error=(ValueError, r"^ignore_index: expected an int"),
    ),
    _case(
        "errors/weight_other_device",
        _bad(weight=lambda a: a["weight"].to("meta")),
        error=(ValueError, r"^weight: expected device"),
    ),
    _case("errors/h_1d", _bad(h=lambda a: a["h"][0]), error=(ValueError, r"^h: expected 2 dims")),
]

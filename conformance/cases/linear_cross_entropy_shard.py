"""Conformance cases for `linear_cross_entropy_shard` (SPEC 2.9.1): one vocabulary shard's per-row max, sum
of exponentials and target logit, with targets in this shard, in another shard and ignored, a GLM-5-like
shard of a split vocabulary, large logits, gradients in h and weight (through sumexp and the target logit).

Semantics: backends/reference/linear_cross_entropy_shard.py (SPEC 2.9.1)
"""

from __future__ import annotations

import torch

from conformance.case import Case, Output
from conformance.cases._common import randint, randn, tdtype, transposed

OUTPUTS = (Output("max", "reduction"), Output("sumexp", "reduction"), Output("target_logit", "reduction"))
GRADS = ("h", "weight")


def _case(id: str, build, **kw) -> Case:
    if id.startswith("errors/"):
        return Case("linear_cross_entropy_shard", id, build, **kw)
    return Case("linear_cross_entropy_shard", id, build, OUTPUTS, grad_args=kw.pop("grad_args", GRADS), **kw)


def mk(
    g: torch.Generator, n, d, v, tp, rank, dt, *, scale=1.0, ignore=0.0, ignore_index=-100, tdt=torch.int64
):
    """Rank `rank`'s shard of a vocabulary of v * tp rows; targets over the whole vocabulary."""
    t = randint(g, 0, v * tp - 1, n)
    t[torch.rand(n, generator=g) < ignore] = ignore_index
    return {
        "h": randn(g, n, d, scale=scale).to(tdtype(dt)),
        "weight": randn(g, v, d, scale=d**-0.5).to(tdtype(dt)),
        "targets": t.to(tdt),
        "vocab_start": rank * v,
        "ignore_index": ignore_index,
    }


def _edges(g, dt):
    """Targets on the shard's first and last rows and on both neighbours' edge rows."""
    a = mk(g, 8, 16, 20, 3, 1, dt)
    a["targets"][:6] = torch.tensor([20, 39, 19, 40, 0, 59])
    a["targets"][6] = -100
    return a


def _bad(**over):
    def build(g, dt):
        a = mk(g, 4, 8, 16, 2, 0, dt)
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


def _noncontig(g, dt):
    a = mk(g, 12, 24, 40, 2, 1, dt, ignore=0.2)
    a["weight"] = transposed(a["weight"])
    return a


CASES = [
    _case(
        "smoke/n8_d16_v32_tp2_rank1",
        lambda g, dt: mk(g, 8, 16, 32, 2, 1, dt, ignore=0.25),
        tags={"shape": "N8 D16 V32/shard tp2"},
    ),
    _case(
        "realistic/n48_d256_v3072_tp8_rank5",
        lambda g, dt: mk(g, 48, 256, 3072, 8, 5, dt, ignore=0.1),
        tags={"shape": "N48 D256 V3072/shard tp8"},
    ),
    _case("adversarial/targets_on_shard_edges_and_neighbours", _edges),
    _case(
        "adversarial/every_target_in_another_shard",
        lambda g, dt: mk(g, 7, 16, 24, 2, 0, dt) | {"vocab_start": 10_000},
    ),
    _case(
        "adversarial/ignore_index_0_int32_targets_rank0",
        lambda g, dt: mk(g, 9, 16, 24, 2, 0, dt, ignore=0.3, ignore_index=0, tdt=torch.int32),
    ),
    _case("adversarial/large_logits", lambda g, dt: mk(g, 10, 32, 64, 2, 1, dt, scale=30.0)),
    _case("adversarial/n1_v1", lambda g, dt: mk(g, 1, 8, 1, 4, 2, dt)),
    _case("adversarial/noncontig_transposed_weight", _noncontig, tags={"layout": "transposed"}),
    _case("adversarial/empty_n0", lambda g, dt: mk(g, 0, 8, 16, 2, 0, dt), trivial=True, grad_args=()),
    _case(
        "errors/vocab_start_negative",
        _bad(vocab_start=-1),
        error=(ValueError, r"^vocab_start: expected an int >= 0"),
    ),
    _case(
        "errors/vocab_start_float",
        _bad(vocab_start=16.0),
        error=(ValueError, r"^vocab_start: expected an int"),
    ),
    _case(
        "errors/weight_v0",
        _bad(weight=lambda a: a["weight"][:0]),
        error=(ValueError, r"^weight: expected shape"),
    ),
    _case(
        "errors/weight_d_mismatch",
        _bad(weight=lambda a: a["weight"][:, :4]),
        error=(ValueError, r"^weight: expected shape"),
    ),
    _case(
        "errors/targets_wrong_length",
        _bad(targets=torch.tensor([0, 1, 2])),
        error=(ValueError, r"^targets: expected shape"),
    ),
    _case(
        "errors/targets_float", _bad(targets=torch.zeros(4)), error=(ValueError, r"^targets: expected dtype")
    ),
    _case("errors/h_1d", _bad(h=lambda a: a["h"][0]), error=(ValueError, r"^h: expected 2 dims")),
]

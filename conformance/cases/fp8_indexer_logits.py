"""Conformance cases for `fp8_indexer_logits` (SPEC 7.4): e4m3 GLM-5 indexer heads (H_I 32, D_I 128) against
an e4m3 key cache with one fp32 scale per key (UE8M0, as DeepSeek-V3.2 / vLLM), ragged and paged, decode,
MTP and prefill rows, ReLU plateaus, negative head weights, zero-length requests, shuffled odd block sizes;
unused cache rows hold NaN codes and NaN scales. Compared with the `reduction` comparator: the reference
is the exact formula rounded once to fp32.

Semantics: backends/reference/fp8_indexer_logits.py (SPEC 7.4)
"""

from __future__ import annotations

from functools import partial

from conformance.case import Case, Output
from conformance.cases._common import Subset, request_subset, strided
from conformance.cases._fp8 import indexer_inputs

OP = "fp8_indexer_logits"
OUTPUTS = (Output("logits", "reduction"),)
REAL = {"h_i": 32, "d_i": 128}


def _case(id: str, build, op: str = OP, outputs=OUTPUTS, **kw) -> Case:
    return Case(op, id, build, () if id.startswith("errors/") else outputs, **kw)


def _bad(op: str, **over):
    def build(g, dt):
        a = indexer_inputs(g, [2, 1], [5, 9])
        if op == "fp8_indexer_topk":
            a["topk"] = 4
        return a | {k: (v(a) if callable(v) else v) for k, v in over.items()}

    return build


def shared_cases(op: str, outputs, extra=None) -> list[Case]:
    """The input families both FP8 indexer ops are checked on (`extra(args)` adds topk)."""
    ex = extra or (lambda a: a)

    def c(id, build, **kw):
        return _case(id, lambda g, dt: ex(build(g, dt)), op, outputs, **kw)

    def paged(bs, g, dt):
        return indexer_inputs(g, [2, 1, 1], [130, 61, 1], block_size=bs)

    return [
        c("smoke/ragged_b2", lambda g, dt: indexer_inputs(g, [2, 1], [5, 9]), tags={"layout": "ragged"}),
        c(
            "smoke/paged_bs4",
            lambda g, dt: indexer_inputs(g, [2, 1], [5, 9], block_size=4),
            tags={"layout": "paged_bs4"},
        ),
        c(
            "realistic/decode_mtp_ragged_s4500",
            lambda g, dt: indexer_inputs(g, [1, 3, 4], [4500, 3000, 2100], **REAL),
            tags={"layout": "ragged", "shape": "T8 H_I32 D_I128 S<=4500"},
        ),
        c(
            "realistic/mtp_paged_bs64_s4200",
            lambda g, dt: indexer_inputs(g, [2, 4, 1], [4200, 2500, 3333], block_size=64, **REAL),
            tags={"layout": "paged_bs64", "shape": "T7 H_I32 D_I128 S<=4200"},
        ),
        c(
            "adversarial/relu_zero_plateau",
            lambda g, dt: indexer_inputs(g, [3, 1], [90, 40], plateau=0.1, weights_sign="positive"),
        ),
        c(
            "adversarial/negative_weights_plateau",
            lambda g, dt: indexer_inputs(g, [2, 2], [50, 30], plateau=0.3),
        ),
        c(
            "adversarial/zero_length_requests",
            lambda g, dt: indexer_inputs(g, [0, 2, 1, 3, 0], [6, 0, 5, 7, 0]),
        ),
        c("adversarial/more_queries_than_keys", lambda g, dt: indexer_inputs(g, [5, 1], [2, 3])),
        c("adversarial/prefill_t_eq_s", lambda g, dt: indexer_inputs(g, [24, 17], [24, 17])),
        *[
            c(f"adversarial/paged_bs{bs}_shuffled", partial(paged, bs), tags={"layout": f"paged_bs{bs}"})
            for bs in (1, 13, 61)
        ],
        c(
            "adversarial/strided_weights",
            lambda g, dt: (lambda a: a | {"weights": strided(a["weights"])})(
                indexer_inputs(g, [3, 2], [40, 9])
            ),
        ),
        _case(
            "errors/q_bf16",
            _bad(op, q=lambda a: a["q"].bfloat16()),
            op,
            error=(ValueError, r"^q: expected dtype"),
        ),
        _case(
            "errors/k_cache_bf16",
            _bad(op, k_cache=lambda a: a["k_cache"].bfloat16()),
            op,
            error=(ValueError, r"^k_cache: expected dtype"),
        ),
        _case(
            "errors/k_scale_shape",
            _bad(op, k_scale=lambda a: a["k_scale"][:, None]),
            op,
            error=(ValueError, r"^k_scale: expected shape"),
        ),
        _case(
            "errors/weights_shape",
            _bad(op, weights=lambda a: a["weights"][:, :2]),
            op,
            error=(ValueError, r"^weights: expected shape"),
        ),
        _case(
            "errors/k_cache_width",
            _bad(op, k_cache=lambda a: a["k_cache"][:, :64], q=lambda a: a["q"]),
            op,
            error=(ValueError, r"^k_cache: expected last dim"),
        ),
    ]


CASES = shared_cases(OP, OUTPUTS)


def batch_subset(args: dict) -> Subset:
    return request_subset(args, ("q", "weights"), "k_cache", width_out=True)

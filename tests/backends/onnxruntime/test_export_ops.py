"""Every contract op, called through the front door of the reference backend as the model calls it, exports
as one call to its glm5 ONNX function (glm5/onnx_export/translation.py), and the exported graph computes
bitwise what the onnxruntime backend computes on the same inputs: the translation chose the same function
variant (ragged / paged, with or without lengths / bias / lse, float / W8A8 / W4A8), the same static
attributes and the same input order. Inputs are the conformance suite's smoke cases; the layout tensors
are graph inputs, as in a real step."""

from __future__ import annotations

from collections import Counter

import onnxruntime as ort
import pytest
import torch

import backends
from backends.layout import SeqLayout
from backends.onnxruntime._session import _to_ort
from backends.onnxruntime.functions import DOMAIN, OPSET
from conformance.cases import select
from glm5.onnx_export.translation import TRANSLATED, attach_functions, translation_table

LAYOUT_FIELDS = ("cu_seqlens_q", "seqlens_k", "cu_seqlens_k", "block_table")
# split-pool caches (backends/cache_layout.py) and FP8 caches (SPEC 7.9) are cache kinds a backend
# declares; onnxruntime declares neither, and the export translates the one-tensor float cache only
CASES = [
    (c, d)
    for c, d in select(ops=TRANSLATED, suite="smoke")
    if not c.tags.get("layout", "").startswith(("split_pools", "fp8_"))
]
DTYPES = sorted({d for _, d in CASES})
#: the glm5 functions the float32 smoke cases must reach (every variant the table chooses between)
FLOAT32_CALLS = {
    "indexer_logits_ragged",
    "indexer_logits_paged",
    "indexer_topk_ragged",
    "indexer_topk_paged",
    "topk",
    "topk_lengths",
    "sparse_mla_attention_ragged",
    "sparse_mla_attention_paged",
    "dynamic_quant_int8",
    "w8a8_matmul",
    "w8a8_matmul_bias",
    "w4a8_matmul",
    "w4a8_matmul_bias",
    "grouped_matmul",
    "linear_cross_entropy",
    "silu_and_mul",
}


class _OneOp:
    """One case's call of `op` on the reference backend, its tensors (layout fields flattened) as inputs."""

    def __init__(self, op: str, args: dict) -> None:
        self.op, self.args = op, args
        self.static = {k: v for k, v in args.items() if not isinstance(v, (torch.Tensor, SeqLayout))}
        self.tensors = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
        lay = args.get("layout")
        self.fields = [f for f in LAYOUT_FIELDS if lay is not None and getattr(lay, f) is not None]
        self.max_k = None if lay is None else lay.max_seqlen_k
        self.names = self.tensors + self.fields
        self.inputs = [(args[n] if n in args else getattr(lay, n)).contiguous() for n in self.names]

    def __call__(self, be, inputs) -> tuple:
        got = dict(zip(self.names, inputs))
        args = {k: got[k] for k in self.tensors} | self.static
        if self.fields:
            lay = {f: got[f] for f in self.fields}
            args["layout"] = SeqLayout(**lay, max_seqlen_k=self.max_k, trusted=True)
        return _outputs(getattr(be, self.op)(**args))


def _outputs(out) -> tuple:
    return tuple(o for o in (out if isinstance(out, tuple) else (out,)) if o is not None)


class _Ops(torch.nn.Module):
    """Every case's call, one after the other, in one graph (one export per dtype, not per case)."""

    def __init__(self, calls: list[_OneOp]) -> None:
        super().__init__()
        self.calls, self.be = calls, backends.get("reference")

    def forward(self, *inputs):
        outs, at = [], 0
        for c in self.calls:
            outs.extend(c(self.be, inputs[at : at + len(c.names)]))
            at += len(c.names)
        return tuple(outs)


def _run(proto, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The model's outputs in ONNX Runtime (CPU EP); tensors cross by DLPack (numpy has no bfloat16)."""
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in proto.graph.input]
    res = sess.run_with_ort_values(
        [o.name for o in proto.graph.output], {n: _to_ort(t) for n, t in zip(names, inputs)}
    )
    return [torch.from_dlpack(v._ortvalue.to_dlpack()) for v in res]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_export_as_their_glm5_functions_and_match_the_onnxruntime_backend(dtype):
    cases = [c for c, d in CASES if d == dtype]
    calls = [_OneOp(c.op, c.build(torch.Generator().manual_seed(c.seed ^ 0x5EED), dtype)) for c in cases]
    inputs = [t for c in calls for t in c.inputs]
    with torch.no_grad():
        program = torch.onnx.export(
            _Ops(calls),
            tuple(inputs),
            dynamo=True,
            opset_version=OPSET,
            custom_translation_table=translation_table(),
            optimize=False,
        )
    proto = attach_functions(program.model_proto)
    fns = Counter(n.op_type for n in proto.graph.node if n.domain == DOMAIN)
    # each op is one call of its own function, not a traced-in body
    assert sum(fns.values()) == len(cases), fns
    if dtype == "float32":
        assert set(fns) == FLOAT32_CALLS

    got = iter(_run(proto, inputs))
    ort_be = backends.get("onnxruntime")
    for case, call in zip(cases, calls):
        for i, w in enumerate(_outputs(getattr(ort_be, case.op)(**call.args))):
            g = next(got)
            torch.testing.assert_close(
                g, w, rtol=0, atol=0, equal_nan=True, msg=f"{case.op}/{case.id} output {i}"
            )
    assert next(got, None) is None

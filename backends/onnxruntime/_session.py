"""Running the `glm5` ONNX functions in ONNX Runtime (CPU EP).

One ONNX model per (function, input dtypes, static attributes): a graph with a single `glm5.<fn>`
node whose model-local functions are that function and everything it calls. Models are checked by
`onnx.checker` (full check) when built; sessions are cached. Tensors cross the boundary through
DLPack (no copy, bfloat16 included). `RUNS` counts session runs per op: the backend's
`kernel_calls()`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnxruntime as ort
import torch
from onnx import helper

from backends.layout import SeqLayout
from backends.onnxruntime.functions import DOMAIN, DOMAIN_VERSION, OPSET, function_closure

RUNS: Counter[str] = Counter()

#: (name, dtype, rank) of a graph input or output
Spec = tuple[str, torch.dtype, int]

_TORCH_TO_ONNX = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.int32: onnx.TensorProto.INT32,
    torch.int64: onnx.TensorProto.INT64,
    torch.bool: onnx.TensorProto.BOOL,
}

#: (fn, input specs, output specs, attributes) -> session; one per distinct static configuration
_sessions: dict[tuple, ort.InferenceSession] = {}


def onnx_dtype(dt: torch.dtype) -> int:
    """The ONNX TensorProto element type of a torch dtype."""
    return _TORCH_TO_ONNX[dt]


def _value_info(name: str, dtype: torch.dtype, rank: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, onnx_dtype(dtype), [f"{name}_{i}" for i in range(rank)])


def build_model(
    fn: str, inputs: Sequence[Spec], outputs: Sequence[Spec], attrs: Mapping[str, Any]
) -> onnx.ModelProto:
    """A model whose graph is one `glm5.<fn>` node; inputs/outputs are (name, dtype, rank), every dim
    symbolic."""
    node = helper.make_node(fn, [s[0] for s in inputs], [s[0] for s in outputs], domain=DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], f"glm5_{fn}", [_value_info(*s) for s in inputs], [_value_info(*s) for s in outputs]
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=function_closure([fn]),
        producer_name="glm5-backends",
    )
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def session(
    fn: str, inputs: Sequence[Spec], outputs: Sequence[Spec], attrs: Mapping[str, Any]
) -> ort.InferenceSession:
    key = (fn, tuple(inputs), tuple(outputs), tuple(sorted(attrs.items())))
    sess = _sessions.get(key)
    if sess is None:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(
            build_model(fn, inputs, outputs, attrs).SerializeToString(),
            opts,
            providers=["CPUExecutionProvider"],
        )
        _sessions[key] = sess
    return sess


def _to_ort(t: torch.Tensor) -> ort.OrtValue:
    return ort.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t.detach().contiguous()))


def run(
    op: str, fn: str, inputs: Mapping[str, torch.Tensor], outputs: Sequence[Spec], **attrs: Any
) -> list[torch.Tensor]:
    """Run `glm5.<fn>` on `inputs` (name -> CPU tensor, in the function's input order) and return its
    `outputs` ((name, dtype, rank) each) as torch tensors; counts one session run for `op`."""
    sess = session(fn, [(n, t.dtype, t.dim()) for n, t in inputs.items()], outputs, attrs)
    res = sess.run_with_ort_values([s[0] for s in outputs], {n: _to_ort(t) for n, t in inputs.items()})
    RUNS[op] += 1
    # DLPack, not .numpy(): numpy has no bfloat16. The torch tensor keeps the OrtValue's buffer alive.
    return [torch.from_dlpack(v._ortvalue.to_dlpack()) for v in res]


def layout_inputs(
    layout: SeqLayout, cache_name: str, cache: torch.Tensor
) -> tuple[str, dict[str, torch.Tensor]]:
    """("ragged" | "paged", the layout tensors the function consumes as they are). A cache with no rows
    is replaced by one zero row of its width: no index can be valid then, and Gather needs a row."""
    if cache.shape[0] == 0 or (cache.dim() == 3 and cache.shape[1] == 0):
        cache = cache.new_zeros((1,) * (cache.dim() - 1) + (cache.shape[-1],))
    tensors = {cache_name: cache}
    tail = {"cu_seqlens_q": layout.cu_seqlens_q, "seqlens_k": layout.seqlens_k}
    if layout.kind == "ragged":
        tail["cu_seqlens_k"] = layout.cu_seqlens_k
    else:
        tail["block_table"] = layout.block_table
    return layout.kind, {**tensors, **tail}


def inference_only(*names: str):
    """A caps `check`: NotSupported when any of `names` requires grad while autograd is recording
    (ORT has no backward); under torch.no_grad() / inference_mode the call is served."""

    def check(args: dict) -> list[str]:
        if not torch.is_grad_enabled():
            return []
        grads = [n for n in names if isinstance(args.get(n), torch.Tensor) and args[n].requires_grad]
        if grads:
            return [f"ONNX Runtime runs inference only, no backward: {', '.join(grads)} require grad"]
        return []

    return check

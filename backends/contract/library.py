"""The contract ops as torch custom ops: `torch.ops.glm5.<op>`, registered once, for every backend.

Engines host kernels this way (vLLM and SGLang register theirs with `torch.library`): the op is one
opaque node to `torch.compile`, `torch.export` and CUDA graphs, with a fake implementation that gives
output shapes and dtypes without running anything. Inside, the real implementation dispatches to the
backend instance named by the op's last argument (`Backend.key`), so one registration serves every
backend, built-in or plugin.

Every op, its fake, its autograd and its `<op>_backward` op are generated from the op's declaration
(backends/reference/<op>.py, by backends/contract/torch_op.py).
Every cache kind takes the same op: one tensor (float rows, or FP8 rows whose kind picks the backend's FP8
kernel); split pools, an inference cache of two tensors, never reach a custom op (backends/contract/door.py:
the implementation serves them directly).

Semantics of every op: backends/reference/<op>.py (docs/spec.md sections 2 and 7).
"""

from __future__ import annotations

from typing import Any

from backends.contract.ops import OPS
from backends.contract.torch_op import register

#: op name -> the custom op (torch.ops.glm5.<op>)
CUSTOM_OPS = {name: register(d) for name, d in OPS.items()}


def custom_op_args(op: str, args: dict[str, Any], key: str) -> tuple:
    """The custom op's positional arguments for the interface's named ones, by declared name (the layout
    flattened in place: its four tensors and max_seqlen_k), the backend key last."""
    return (*OPS[op].flatten(args), key)


def named_args(op: str, flat: tuple) -> dict[str, Any]:
    """The interface's named arguments of a call of op's custom op (its positional arguments, the backend
    key last): what a counting mode reads (glm5/deploy/counting.py). Tensors may be fake."""
    return OPS[op].unflatten(tuple(flat[:-1]), fake=True)


def call(key: str, op: str, args: dict[str, Any]) -> Any:
    """Call op's custom op with the interface's named arguments."""
    return as_asked(op, args, CUSTOM_OPS[op](*custom_op_args(op, args, key)))


def as_asked(op: str, args: dict[str, Any], out: Any) -> Any:
    """The custom op's result as the interface returns it for `args` (the declaration's `returns`:
    sparse attention's lse is None unless return_lse; linear cross-entropy's loss alone)."""
    return OPS[op].as_asked(args, out)

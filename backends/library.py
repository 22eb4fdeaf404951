"""The contract ops as torch custom ops: `torch.ops.glm5.<op>`, registered once, for every backend.

Engines host kernels this way (vLLM and SGLang register theirs with `torch.library`): the op is one
opaque node to `torch.compile`, `torch.export` and CUDA graphs, with a fake implementation that gives
output shapes and dtypes without running anything. Inside, the real implementation dispatches to the
backend instance named by the op's last argument (`Backend.key`), so one registration serves every
backend, built-in or plugin.

Every op, its fake, its autograd and its `<op>_backward` op are generated from the op's declaration
(backends/reference/<op>.py, by backends/decl_torch.py). Hand-made here: `sparse_mla_attention_pools`, the
same op on a split-pool cache (backends/cache_layout.py; inference only).

Semantics of every op: backends/reference/<op>.py (docs/spec.md sections 2 and 7).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backends.cache_layout import MLAPools
from backends.custom_op import _lib_op, _run
from backends.decl_torch import register
from backends.decls import DECLS

#: op name -> the custom op (torch.ops.glm5.<op>)
CUSTOM_OPS = {name: register(d) for name, d in DECLS.items()}

_ATTENTION = DECLS["sparse_mla_attention"]


@_lib_op("sparse_mla_attention_pools")
def sparse_mla_attention_pools(
    q: Tensor,
    kv_latent: Tensor,
    kv_rope: Tensor,
    indices: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    cu_seqlens_k: Tensor | None,
    block_table: Tensor | None,
    max_seqlen_k: int,
    sm_scale: float,
    d_v: int,
    return_lse: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """sparse_mla_attention on a split-pool cache (lse: empty [0] float32 when return_lse is False)."""
    flat = (q, kv_latent, indices, cu_seqlens_q, seqlens_k, cu_seqlens_k, block_table, max_seqlen_k)
    args = _ATTENTION.unflatten((*flat, sm_scale, d_v, return_lse))
    out, lse = _run(backend, "sparse_mla_attention", {**args, "kv_cache": MLAPools(kv_latent, kv_rope)})
    none = lse is None or not return_lse
    return out, q.new_empty((0,), dtype=torch.float32) if none else lse


@sparse_mla_attention_pools.register_fake
def _(q, kv_latent, kv_rope, indices, cu_q, sk, cu_k, bt, max_k, sm_scale, d_v, return_lse, backend):
    t, h, _ = q.shape
    return q.new_empty((t, h, d_v)), q.new_empty((t, h) if return_lse else (0,), dtype=torch.float32)


def custom_op_args(op: str, args: dict[str, Any], key: str) -> tuple:
    """The custom op's positional arguments for the interface's named ones, by declared name (the layout
    flattened in place: its four tensors and max_seqlen_k), the backend key last."""
    return (*DECLS[op].flatten(args), key)


def named_args(op: str, flat: tuple) -> dict[str, Any]:
    """The interface's named arguments of a call of op's custom op (its positional arguments, the backend
    key last): what a counting mode reads (glm5/deploy/counting.py). Tensors may be fake."""
    return DECLS[op].unflatten(tuple(flat[:-1]), fake=True)


def call(key: str, op: str, args: dict[str, Any]) -> Any:
    """Call op's custom op with the interface's named arguments (a split-pool cache: its own op)."""
    pools = args.get("kv_cache")
    if op == "sparse_mla_attention" and isinstance(pools, MLAPools):
        flat = custom_op_args(op, {**args, "kv_cache": pools.latent}, key)
        return as_asked(op, args, sparse_mla_attention_pools(flat[0], pools.latent, pools.rope, *flat[2:]))
    return as_asked(op, args, CUSTOM_OPS[op](*custom_op_args(op, args, key)))


def as_asked(op: str, args: dict[str, Any], out: Any) -> Any:
    """The custom op's result as the interface returns it for `args` (the declaration's `returns`:
    sparse attention's lse is None unless return_lse; linear cross-entropy's loss alone)."""
    return DECLS[op].as_asked(args, out)

"""cuda backend: fp8_sparse_mla_attention (SPEC 7.7) -> kernels_cuda.fp8_sparse_mla (forward; the 656-byte
rows de-quantized in registers as FlashMLA's SM90 kernel: bf16(fp8) * bf16(scale) rounded to bf16).

bf16 and fp32 q; fp16 q is declined (K would be rounded from bf16 to fp16, which FlashMLA never does).
Forward only: inputs that require grad are declined (the FP8 cache is an inference cache)."""

from __future__ import annotations

import torch

from backends.cache_layout import FP8_KINDS
from backends.caps import OpCaps, OpImpl
from backends.contract.limits import Limit
from backends.layout import SeqLayout
from kernels_cuda.fp8_sparse_mla import fp8_sparse_mla_fwd as _kernel

MAX_HEADS = 128
HEADS_LIMIT = Limit("heads", max=MAX_HEADS, reason="GLM-5 and FlashMLA use 64 or 128 query heads")


def fp8_sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    layout: SeqLayout,
    sm_scale: float,
    d_v: int,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Semantics: backends/reference/fp8_sparse_mla_attention.py (SPEC 7.7)"""
    out, lse = _kernel(
        q,
        kv_cache,
        indices,
        sm_scale,
        layout.cu_seqlens_q,
        layout.seqlens_k,
        layout.cu_seqlens_k,
        layout.block_table,
    )
    return out, (lse if return_lse else None)


IMPL = OpImpl(
    fp8_sparse_mla_attention,
    OpCaps(("float32", "bfloat16"), FP8_KINDS, limits=(HEADS_LIMIT,)),
)

"""EMULATION of `torch_npu.npu_swiglu` (torch_npu 2.1+ docs, "SwiGlu"; Atlas A2, and A3 from 2.6.0).

Documented semantics: `input` is cut in half along `dim` (default -1) into A (first half) and B (second
half); out = swish(A) * B = A * sigmoid(A) * B, of the dtype of `input`. `input` is fp32, fp16 or bf16,
1 to 8 dims, even along `dim`, contiguous and not empty. The docs do not state the internal precision:
emulated as fp32 arithmetic rounded once to the input's dtype (the contract's SPEC 2.10); a device run
checks that against the reference.
"""

from __future__ import annotations

import torch

from backends.ascend.emulation._checks import need, need_dtype

OP = "npu_swiglu"


def npu_swiglu(input, dim=-1):
    need_dtype(OP, "input", input, (torch.float32, torch.float16, torch.bfloat16))
    need(1 <= input.dim() <= 8, OP, "input", "1 to 8 dims", list(input.shape))
    need(-input.dim() <= dim < input.dim(), OP, "dim", f"in [{-input.dim()}, {input.dim() - 1}]", dim)
    need(input.shape[dim] % 2 == 0, OP, "input", f"an even size along dim {dim}", list(input.shape))
    need(input.is_contiguous(), OP, "input", "a contiguous tensor", "a non-contiguous one")
    need(input.numel() > 0, OP, "input", "a non-empty tensor", list(input.shape))
    a, b = input.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(input.dtype)

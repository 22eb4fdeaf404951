"""EMULATION of `torch_npu.npu_dynamic_quant` (torch_npu 2.14; op-plugin golden test).

Documented semantics (per-token symmetric, int8 output): over the last dim,
`scale = rowmax(|x|) / 127` (fp32, shape x.shape[:-1]) and `y = round(x / scale)` (half to even),
computed in fp32. The docs do not special-case all-zero rows: the formula gives scale 0 and 0/0,
emulated as scale = 0 and y = 0, so a caller that needs a floor on the scale must apply it.

Limits enforced: x fp16/bf16 with >= 2 dims. `smooth_scales`, `group_index`, `dst_type=quint4x2` and
other quant modes exist on the real operator but are not emulated (the backend does not use them).
"""

from __future__ import annotations

import torch

from backends.ascend.emulation._checks import NotEmulated, need, need_dtype

OP = "npu_dynamic_quant"


def npu_dynamic_quant(
    input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0
):
    need_dtype(OP, "input", input, (torch.float16, torch.bfloat16))
    need(input.dim() >= 2, OP, "input", ">= 2 dims", list(input.shape))
    if smooth_scales is not None or group_index is not None or quant_mode != "pertoken" or dst_type_max:
        raise NotEmulated(f"{OP}: smooth_scales / group_index / quant_mode={quant_mode!r} / dst_type_max")
    if dst_type not in (None, torch.int8):
        raise NotEmulated(f"{OP}: dst_type={dst_type} (emulated: int8)")
    xf = input.float()
    scale = xf.abs().amax(dim=-1) / 127  # x.shape[:-1], fp32
    y = torch.round(xf / scale[..., None])
    y = torch.nan_to_num(y, nan=0.0).to(torch.int8)
    return y, scale

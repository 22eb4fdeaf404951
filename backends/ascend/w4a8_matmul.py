"""ascend backend: w4a8_matmul (SPEC 2.7).

Per-channel weights (group_size == K), no bias, bf16/fp16 output -> torch_npu.npu_grouped_matmul's
int4 path with one group, the weights repacked (once by `prepare`; else per call, counted in
relayouts) from the contract's layout (uint8 [N, K//2], two nibbles along K) to torch_npu's (int32
[K, N/8], eight nibbles along N), the scale as fp32 bits in int64, and msModelSlim's scale_bias (8 *
sum_k w * scale) as `bias` (see grouped_matmul.py).
Everything else (per-group scales, a bias, fp32 output) -> kernels_ascend.w4a8_matmul, bitwise.
Semantics: backends/reference/w4a8_matmul.py (SPEC 2.7)
"""

from __future__ import annotations

import torch

from backends.ascend import _adapters as ad
from backends.ascend._provider import BATCH_INVARIANT, OpsProvider
from backends.ascend.grouped_matmul import w4_form, w4a8_operator
from backends.caps import OpCaps, OpImpl
from backends.contract.ops import FLOATS


def uses_operator(group_size: int, k: int, bias, out_dtype) -> bool:
    return group_size == k and bias is None and out_dtype in (torch.bfloat16, torch.float16)


def impl(provider: OpsProvider) -> OpImpl:
    def w4a8_matmul(x_q, x_scale, w_packed, w_scale, group_size, bias=None, out_dtype=torch.bfloat16):
        m = x_q.shape[0]
        if uses_operator(group_size, x_q.shape[1], bias, out_dtype):
            offsets = torch.tensor([0, m], dtype=torch.int64, device=x_q.device)
            w3, s2 = w_packed[None], w_scale[:, :1].T  # one group: [1, N, K//2], [1, N]
            form = w4_form(provider, "w4a8_matmul", (w_packed, w_scale), w3, s2)
            return w4a8_operator(provider, "w4a8_matmul", x_q, x_scale, w3, s2, offsets, out_dtype, form)
        from kernels_ascend.w4a8_matmul import w4a8_matmul as kernel

        provider.record("w4a8_matmul", provider.kernel_label("w4a8_matmul"))
        return kernel(x_q, x_scale, w_packed, w_scale, group_size, bias, out_dtype)

    def check(a: dict) -> list[str]:
        if a["group_size"] % 2 and not uses_operator(
            a["group_size"], a["x_q"].shape[1], a["bias"], a["out_dtype"]
        ):
            return [f"group_size {a['group_size']} is odd: a packed byte would straddle two groups"]
        return []

    def prepare(weights: dict) -> dict:
        """Per-channel weights (w_scale [N, 1]) keep their bytes; their npu_grouped_matmul repack is
        stored beside them. Per-group weights go to the kernel, which reads the contract's layout."""
        w, s = weights.get("w_packed"), weights.get("w_scale")
        if w is not None and s is not None and s.dim() == 2 and s.shape[1] == 1:
            provider.forms.put((w, s), ad.repack_w4_for_npu(w[None], s[:, :1].T))
        return dict(weights)

    return OpImpl(w4a8_matmul, OpCaps(FLOATS, check=check, batch_invariant=BATCH_INVARIANT), prepare)

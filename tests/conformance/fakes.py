"""Small in-process backends for testing the runner: each is wrong in one known way."""

from __future__ import annotations

from collections import Counter

import torch

from backends import Backend, OpCaps, OpImpl
from backends.reference.topk import topk as reference_topk


def quant_own(x):
    """dynamic_quant_int8 written independently of the reference (same formula)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quant_half_away(x):
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(1e-10) / 127
    y = xf / scale[:, None]
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


_noise = torch.Generator().manual_seed(123)


def grouped_noisy(x, w, group_offsets, x_scale=None, w_scale=None, group_size=None, out_dtype=None):
    """Right to within fp32 tolerance, but different bits on every call."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    offs = group_offsets.tolist()
    for e in range(w.shape[0]):
        out[offs[e] : offs[e + 1]] = x[offs[e] : offs[e + 1]].double() @ w[e].double().T
    jitter = 1 + 1e-7 * torch.rand(out.shape, generator=_noise, dtype=torch.float64)
    return (out * jitter).to(out_dtype or x.dtype)


class QuantOnlyFloat32(Backend):
    """Claims float32 only, though its implementation serves every float dtype."""

    name = "fake_quant"
    ops = {"dynamic_quant_int8": OpImpl(quant_own, OpCaps(("float32",)))}


class Fallback(Backend):
    """topk silently calls the reference."""

    name = "fake_fallback"
    ops = {
        "topk": OpImpl(
            lambda x, k, lengths=None: reference_topk(x, k, lengths),
            OpCaps(("float32",), tie_rule="lower_index"),
        )
    }


class NoKernel(QuantOnlyFloat32):
    """Reports no kernel work at all."""

    name = "fake_nokernel"

    def kernel_calls(self) -> Counter[str]:
        return Counter()


class IgnoresClaims(QuantOnlyFloat32):
    """Serves unclaimed dtypes instead of raising NotSupported."""

    name = "fake_ignores_claims"

    def reasons(self, op, args, placed=False):
        return []


class WrongRounding(Backend):
    """Claims float32 and bfloat16; rounds half away from zero."""

    name = "fake_rounding"
    ops = {"dynamic_quant_int8": OpImpl(quant_half_away, OpCaps(("float32", "bfloat16")))}


class Nondeterministic(Backend):
    """grouped_matmul within tolerance but claiming run_to_run and batch_invariant falsely."""

    name = "fake_nondet"
    ops = {"grouped_matmul": OpImpl(grouped_noisy, OpCaps(("float32",)))}


def quant_in_place(x):
    x_q, scale = quant_own(x)
    x.zero_()  # scribbles over its input
    return x_q, scale


class MutatesInput(Backend):
    name = "fake_mutates"
    ops = {"dynamic_quant_int8": OpImpl(quant_in_place, OpCaps(("float32",)))}

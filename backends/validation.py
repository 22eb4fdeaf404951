"""Input validation shared by every backend (SPEC 2: a `ValueError` naming the argument, the
expected and the actual shape/dtype/device).

Validation comes in tiers, so the hot path never reads the device back to the host:
- `check_<op>`: shapes, dtypes, devices and Python scalars. Every call; no tensor values are read.
- `values_<op>`: checks that need tensor values (offsets monotone and ending at M, lengths in range,
  targets in range). They run on every call only under `GLM5_VALIDATE=values` (or `=reference`);
  layouts are value-checked once per `SeqLayout` object (`SeqLayout.check`), whatever the mode.
`Backend` calls them before dispatching, so a backend's own code may assume well-formed inputs and
only has to decline (`NotSupported`) what it cannot serve.
- `unchecked_<op>` (a declaration's `unchecked`): when the value checks do not run, the front door
  maps out-of-range values to one defined result on device (a clamp, a sort, a mask; no host reads),
  so every backend returns the same thing for them instead of reading out of bounds (SPEC 10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.argcheck import (  # noqa: F401  (re-exported: the validators' shared vocabulary)
    FLOAT_DTYPES,
    _shape,
    check_int,
    check_same_device,
    check_tensor,
    fail,
)
from backends.layout import SeqLayout


def check_cache(name: str, cache: torch.Tensor, layout: SeqLayout, width: int, dtype) -> None:
    if layout.kind == "ragged" and cache.dim() != 2:
        fail(name, "a ragged cache [rows, D] (the layout has cu_seqlens_k)", f"shape {_shape(cache)}")
    if layout.kind == "paged" and cache.dim() != 3:
        fail(
            name,
            "a paged cache [num_blocks, block_size, D] (the layout has block_table)",
            f"shape {_shape(cache)}",
        )
    check_tensor(name, cache, dtype=dtype)
    if cache.shape[-1] != width:
        fail(name, f"last dim {width}", f"shape {_shape(cache)}")


def check_layout(layout: object, num_tokens: int, cache: torch.Tensor, cache_name: str) -> None:
    if not isinstance(layout, SeqLayout):
        fail("layout", "a backends.SeqLayout", type(layout).__name__)
    if layout.device != cache.device:
        fail("layout", f"device {cache.device} (as {cache_name})", layout.device)


def check_heads(q: torch.Tensor) -> None:
    """An indexer's q [T, H_I, D_I] has at least one head and a non-empty head dim (a score summed over
    no heads is no score: reference and cpu failed in a reshape, onnxruntime returned zeros)."""
    if q.shape[1] < 1 or q.shape[2] < 1:
        fail("q", "[T, H_I, D_I] with H_I >= 1 and D_I >= 1", f"shape {_shape(q)}")


# -- one checker per op (SPEC 2.x) --------------------------------------------------------------


#: the bytes of a key of the FP8 indexer cache past its D_I e4m3 values (one fp32 scale; SPEC 7.8)
INDEX_SCALE_BYTES = 4
#: FlashMLA's FP8 latent row (SPEC 7.6): q [T, H, 576], d_v 512, 656 bytes a row
MLA_D_QK, MLA_D_V, MLA_ROW_BYTES = 576, 512, 656


#: a top-k wider than its candidates only adds -1 / -inf padding (SPEC 9); past this width it is refused
#: before anything is allocated (GLM-5's indexer asks for 2048, the cuda kernels serve up to 8192)
MAX_PADDED_TOPK = 1 << 16


def check_topk_width(name: str, k: object, candidates: int, what: str) -> None:
    check_int(name, k, min_value=1)
    if k > max(candidates, MAX_PADDED_TOPK):
        fail(name, f"an int in [1, max({candidates}, {MAX_PADDED_TOPK})] (wider than {what} only pads)", k)


def check_epilogue(m: int, n: int, x_scale, w_scale_shape, w_scale, bias, out_dtype, **devs) -> None:
    check_tensor("x_scale", x_scale, dtype=torch.float32, shape=(m,))
    check_tensor("w_scale", w_scale, dtype=torch.float32, shape=w_scale_shape)
    if bias is not None:
        check_tensor("bias", bias, dtype=FLOAT_DTYPES, shape=(n,))
    if out_dtype not in FLOAT_DTYPES:
        fail("out_dtype", "one of torch.float32, torch.float16, torch.bfloat16", out_dtype)
    check_same_device(x_scale=x_scale, w_scale=w_scale, bias=bias, **devs)


def check_group_size(k: int, group_size) -> None:
    check_int("group_size", group_size, min_value=1)
    if k % group_size:
        fail("group_size", f"a divisor of K={k}", group_size)


# -- without value checks (SPEC 10): one defined result for out-of-range values, on device --------------
# Each takes the validated arguments and returns them with out-of-range values mapped, plus a function
# applied to the op's result (or None). Under GLM5_VALIDATE=values the value checks raise instead.

Finish = Callable[[Any], Any] | None


def _defined_offsets(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """0, then every later offset clamped to [0, M] and sorted (rows past the last offset are padding,
    SPEC 2.8; ops torch.export and the ONNX export both take: no cummax, no in-place writes)."""
    return torch.nn.functional.pad(offsets[1:].clamp(0, m).sort(stable=True).values, (1, 0), value=0)


def unchecked_offsets(rows_arg: str) -> Callable[[dict[str, Any]], tuple[dict[str, Any], Finish]]:
    def unchecked(args: dict[str, Any]) -> tuple[dict[str, Any], Finish]:
        m = args[rows_arg].shape[0]
        return {**args, "group_offsets": _defined_offsets(args["group_offsets"], m)}, None

    return unchecked

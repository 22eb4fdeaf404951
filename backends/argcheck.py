"""The validators' vocabulary (SPEC 2): argument checks every op's validator (its `check`, in
backends/reference/<op>.py) builds on, each a `ValueError` naming the argument, the expected and the
actual value.

Validation comes in tiers, so the hot path never reads the device back to the host:
- a declaration's `validate`: shapes, dtypes, devices and Python scalars. Every call; no tensor values
  are read (nothing here reads one).
- its `values`: checks that need tensor values (offsets monotone and ending at M, lengths in range,
  targets in range). They run on every call only under `GLM5_VALIDATE=values` (or `=reference`);
  layouts are value-checked once per `SeqLayout` object (`SeqLayout.check`), whatever the mode.
`Backend` calls them before dispatching, so a backend's own code may assume well-formed inputs and
only has to decline (`NotSupported`) what it cannot serve.
- its `unchecked`: when the value checks do not run, the front door maps out-of-range values to one
  defined result on device (a clamp, a sort, a mask; no host reads), so every backend returns the same
  thing for them instead of reading out of bounds (SPEC 10); `unchecked_offsets` is the grouped ops'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    pass

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fail(arg: str, expected: object, actual: object) -> NoReturn:
    raise ValueError(f"{arg}: expected {expected}, got {actual}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check one tensor argument; `None` in `shape` matches any size."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else "one of " + ", ".join(str(d) for d in allowed)
            fail(name, f"dtype {want}", t.dtype)
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_nd:
            fail(name, f"{' or '.join(str(n) for n in allowed_nd)} dims", f"shape {_shape(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            fail(name, f"shape {want}", f"shape {_shape(t)}")
    if device is not None and t.device != device:
        fail(name, f"device {device}", t.device)
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    for n, t in items:  # a list or a number where a tensor belongs: the same ValueError on every backend
        if not isinstance(t, torch.Tensor):
            fail(n, "a torch.Tensor", type(t).__name__)
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            fail(n, f"device {first.device} (as {first_name})", t.device)


def check_int(name: str, v: object, *, min_value: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(name, "an int", type(v).__name__)
    if min_value is not None and v < min_value:
        fail(name, f"an int >= {min_value}", v)
    return v


def check_heads(q: torch.Tensor) -> None:
    """An indexer's q [T, H_I, D_I] has at least one head and a non-empty head dim (a score summed over
    no heads is no score: reference and cpu failed in a reshape, onnxruntime returned zeros)."""
    if q.shape[1] < 1 or q.shape[2] < 1:
        fail("q", "[T, H_I, D_I] with H_I >= 1 and D_I >= 1", f"shape {_shape(q)}")


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


# -- the FP8 ops' (SPEC 7) ---------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn
BLOCK = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        fail("out_dtype", "one of torch.float32, torch.float16, torch.bfloat16", out_dtype)

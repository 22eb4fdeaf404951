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
from backends.cache_layout import MLAPools
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


def _check_pools(pools: MLAPools, layout: SeqLayout, d_qk: int, dtype) -> None:
    """A split-pool latent cache (SPEC 2.4): latent [nb, bs, 1, c] and rope [nb, bs, 1, r], c + r = d_qk."""
    if layout.kind != "paged":
        fail("kv_cache", "one tensor [rows, D] for a ragged layout (split pools are paged)", "split pools")
    lat, rope = pools.latent, pools.rope
    check_tensor("kv_cache.latent", lat, dtype=dtype, ndim=4)
    check_tensor("kv_cache.rope", rope, dtype=dtype, ndim=4)
    nb, bs = lat.shape[:2]
    if lat.shape[2] != 1:
        fail("kv_cache.latent", "shape [num_blocks, block_size, 1, c] (one KV head)", f"shape {_shape(lat)}")
    if tuple(rope.shape[:3]) != (nb, bs, 1):
        fail("kv_cache.rope", f"shape [{nb}, {bs}, 1, r] (blocks as the latent)", f"shape {_shape(rope)}")
    if lat.shape[-1] + rope.shape[-1] != d_qk:
        fail("kv_cache", f"pool widths c + r == d_qk ({d_qk})", f"{lat.shape[-1]} + {rope.shape[-1]}")


def check_sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True) -> None:
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    t, _, d_qk = q.shape
    pools = isinstance(kv_cache, MLAPools)
    fp8 = not pools and isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8
    if not pools:
        check_tensor("kv_cache", kv_cache, ndim=(2, 3))
        if not fp8 and kv_cache.dtype != q.dtype:
            fail("kv_cache", f"dtype {q.dtype} (as q) or uint8 (FP8 rows)", kv_cache.dtype)
    if fp8 and d_qk != MLA_D_QK:  # FlashMLA's 656-byte rows hold 512 latent + 64 RoPE
        fail("q", f"shape [T, H, {MLA_D_QK}] (a kv_cache of FP8 rows)", f"shape {_shape(q)}")
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != t:
        fail("indices", f"shape [T={t}, topk]", f"shape {_shape(indices)}")
    if pools:
        check_same_device(**{"q": q, "kv_cache.latent": kv_cache.latent, "kv_cache.rope": kv_cache.rope})
        check_same_device(q=q, indices=indices)
        check_layout(layout, t, kv_cache.latent, "kv_cache")
        _check_pools(kv_cache, layout, d_qk, q.dtype)
    else:
        check_same_device(q=q, kv_cache=kv_cache, indices=indices)
        check_layout(layout, t, kv_cache, "kv_cache")
        width, dtype = (MLA_ROW_BYTES, torch.uint8) if fp8 else (d_qk, q.dtype)
        check_cache("kv_cache", kv_cache, layout, width, dtype)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not (sm_scale == sm_scale):
        fail("sm_scale", "a finite float", sm_scale)
    if abs(float(sm_scale)) == float("inf"):
        fail("sm_scale", "a finite float", sm_scale)
    check_int("d_v", d_v, min_value=1)
    if d_v > d_qk:
        fail("d_v", f"<= d_qk ({d_qk})", d_v)
    if fp8 and d_v != MLA_D_V:
        fail("d_v", f"{MLA_D_V} (the latent width of a kv_cache of FP8 rows)", d_v)
    if not isinstance(return_lse, bool):
        fail("return_lse", "a bool", type(return_lse).__name__)


def values_sparse_mla_attention(q, kv_cache, indices, layout, sm_scale, d_v, return_lse=True) -> None:
    layout.check(q.shape[0], kv_cache, "kv_cache")


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

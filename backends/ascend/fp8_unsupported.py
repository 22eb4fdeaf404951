"""Why the ascend backend declares every FP8 op (SPEC 7) and serves none.

Atlas A2/A3 (Ascend 910B/910C) cube units multiply fp16/bf16 and int8/int4, not e4m3 (the FP8 formats
arrive with Ascend 950's HiF8/FP8 datapath, which torch_npu does not expose for these ops yet). A
GLM-5-FP8 checkpoint is served on Ascend by converting it (`glm5 quantize` from an FP8 source, block by
block, to the W8A8 / W4A8 recipe), not by emulating e4m3 GEMMs in fp16. The op is declared with that
reason, so NotSupported says it rather than "not implemented".
"""

from __future__ import annotations

from typing import Any

from backends.caps import OpCaps, OpImpl
from backends.errors import NotSupported

REASON = (
    "no FP8 datapath on Atlas A2/A3 (the cube units take fp16/bf16/int8/int4, not e4m3); convert the "
    "FP8 checkpoint with `glm5 quantize --model FP8_DIR --recipe glm5-w8a8 --format modelslim` and use "
    "the int8 ops"
)


def _never(_args: dict[str, Any]) -> list[str]:
    return [REASON]


def declined(fn, dtypes: tuple[str, ...], layouts: tuple[str, ...] = ()) -> OpImpl:
    """An OpImpl whose caps decline every call with REASON; `fn` raises the same if reached directly."""

    def guard(*_a, **_k):
        raise NotSupported([REASON], backend="ascend", op=fn.__name__)

    guard.__signature__ = __import__("inspect").signature(fn)
    guard.__name__ = fn.__name__
    return OpImpl(guard, OpCaps(dtypes, layouts, notes={"fp8": REASON}, check=_never))

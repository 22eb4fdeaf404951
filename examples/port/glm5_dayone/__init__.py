"""The `dayone` backend: a chip's first hour. One op is ported (`grouped_matmul`, float); every other op
is borrowed from the reference (run on host copies, counted in `borrow_ledger`), so the whole model runs
end to end while the ops are ported one by one. Porting the next op: write `glm5_dayone/<op>.py` and name
it in `every_op_except(...)`.

    pip install -e examples/port
    glm5 generate --preset tiny --backend dayone --max-new-tokens 8
    glm5 port status dayone          # grouped_matmul rows passing, the borrowed rows with their cost
"""

from __future__ import annotations

import platform

import torch

from backends.borrow import every_op_except
from backends.contract.table import load_ops
from backends.interface import Backend


class DayoneBackend(Backend):
    name = "dayone"
    device = "cpu"  # the chip's torch device type once it is wired in ("npu", "xpu", ...)
    ops = load_ops("glm5_dayone")
    borrow = every_op_except("grouped_matmul")

    def environment(self) -> dict[str, str]:
        return {"torch": torch.__version__, "python": platform.python_version()}

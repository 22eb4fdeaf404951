"""triton-ascend kernels for the Ascend backend (and CPU tensors under TRITON_INTERPRET=1, triton-ascend's
interpreter). No model or backend imports.

Written to Ascend's rules (the triton-ascend programming guide): the grid is the physical core count
(vector cores for pure-vector kernels, AI cores for kernels using tl.dot) and every program loops
over its share of the work; 1-D grids only; tiles sized well inside the 192 KB unified buffer (half of
it with the default multi-buffering); no tl.sort (not on int32/int64 on the NPU, and absent from the
interpreter); bf16 operands are widened to fp32 before tl.dot (the interpreter's bf16 dot is wrong).
Every public launcher counts its launches in `LAUNCHES`.
"""

from kernels_ascend._launch import LAUNCHES, count_launch, interpreter_active, num_cores

__all__ = ["LAUNCHES", "count_launch", "interpreter_active", "num_cores"]

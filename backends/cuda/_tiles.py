"""Which row-invariance the cuda backend can claim where it runs.

A kernel whose M-tiles hold the rows of several tokens (grouped_matmul, fp8_block_matmul,
fp8_grouped_matmul) is batch-invariant on a GPU by construction: a row's fp32 dot is the same MMA
sequence over the same K blocks wherever the row sits in its tile and whatever the tile's other rows
hold (the float tile shape is fixed: kernels_cuda.grouped_matmul._config). Under TRITON_INTERPRET
`tl.dot` is one NumPy (BLAS) product of the whole tile, and the order in which BLAS sums a row
depends on the tile's other rows and on the kernel the CPU gets: OpenBLAS runs an AMD Zen 5 on its
Haswell kernels, where a row alone and the same row in a full tile differ in the last bit, and a
Zen 4 on its SkylakeX kernels, where they happen not to. So the claim is made on a device only.
Kernels that give each token its own tile (attention, the indexers) or whose sums are exact integers
(W8A8, W4A8's group dots) keep their claim under the interpreter too.
"""

from __future__ import annotations

from kernels_cuda._launches import interpreter_active

#: batch_invariant for the kernels that tile several tokens' rows together (see above)
SHARED_TILE_ROWS_INVARIANT = not interpreter_active()
#: the note those ops carry, shown by `glm5 ops NAME` and the reports
SHARED_TILE_NOTE = {
    "batch_invariant": "on a GPU; not claimed under TRITON_INTERPRET, where a tile's dot is NumPy's BLAS"
}

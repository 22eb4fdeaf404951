"""The batch-invariant mode (SPEC 12): the switch and the exact engines (engine.py), the
batch-invariant GEMM kernels (gemm.py)."""

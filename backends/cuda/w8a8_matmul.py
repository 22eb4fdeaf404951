"""cuda backend: w8a8_matmul (not implemented yet: the table in backends/cuda/__init__.py leaves it out)."""

IMPL = None

"""cuda backend: linear_cross_entropy (not implemented yet: the table in backends/cuda/__init__.py leaves it out)."""

IMPL = None

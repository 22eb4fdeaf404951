"""cuda backend: sparse_mla_attention (not implemented yet: the table in backends/cuda/__init__.py leaves it out)."""

IMPL = None

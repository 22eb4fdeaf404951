"""cuda backend: dynamic_quant_int8 (not implemented yet: the table in backends/cuda/__init__.py leaves it out)."""

IMPL = None

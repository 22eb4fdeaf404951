"""The contract machinery: one declaration per op (decl.py; each in backends/reference/<op>.py),
the op table (ops.py), the limits (limits.py), the front door (door.py), the typed methods of `Backend`
(typed_ops.py, typed_fp8.py), the custom ops (library.py, torch_op.py, custom_op.py) and every backend's
op table (table.py)."""

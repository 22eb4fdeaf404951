"""An op declaration (backends/contract/decl.py) as a torch custom op: `torch.ops.glm5.<op>`, its fake, and
for a differentiable op its autograd and its `<op>_backward` op, all generated from the declaration.

The schema is the declared signature's (`OpDecl.schema`, a SeqLayout flattened to its tensors and
`max_seqlen_k`, the backend key last) and is checked against what torch registered. The real
implementation dispatches to the backend instance named by the key (backends/contract/custom_op.py); an output
the arguments did not ask for (sparse attention's lse under return_lse=False) crosses the boundary as an
empty [0] float32 tensor, since a schema has no optional outputs.

The backward op takes the output gradients, the forward's arguments and, where the declaration says the
backward reads them (`saves_outputs`), the forward's outputs, and returns one gradient per `grad_args`
from the backend's declared backward (`OpImpl.backward`): each forward runs once in a training step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backends.contract.custom_op import NAMESPACE, _run, instance, no_alias, run_backward
from backends.contract.decl import OpDecl


def _placeholders(like: Tensor, outs: Any, n: int) -> Any:
    """A result in the schema's form: None outputs as empty [0] fp32 tensors."""
    if n == 1:
        return outs
    return tuple(like.new_empty((0,), dtype=torch.float32) if o is None else o for o in outs)


def _first_tensor(flat: tuple) -> Tensor:
    return next(t for t in flat if isinstance(t, Tensor))


def _check_schema(op: Any, d: OpDecl, schema: str, name: str) -> None:
    got = str(op._opoverload._schema)
    if got != f"{NAMESPACE}::{name}{schema}":
        raise RuntimeError(f"{name}: torch registered {got}, the declaration generates {schema}")


def register(d: OpDecl) -> Any:
    """Register `torch.ops.glm5.<d.name>` (with its backward where `d.grad_args`); return the op."""

    def forward(*flat: Any) -> Any:
        args = d.unflatten(flat[:-1])
        out = no_alias(instance(flat[-1]).run(d.name, args), args)
        return _placeholders(_first_tensor(flat), out, d.num_outputs)

    def fake(*flat: Any) -> Any:
        return _placeholders(_first_tensor(flat), d.fake(d.unflatten(flat[:-1], fake=True)), d.num_outputs)

    schema = d.schema()
    op = torch.library.custom_op(f"{NAMESPACE}::{d.name}", forward, mutates_args=(), schema=schema)
    op.register_fake(fake)
    _check_schema(op, d, schema, d.name)
    if d.grad_args:
        _register_autograd(d, op)
    return op


def backward_schema(d: OpDecl) -> str:
    grads = ", ".join(f"Tensor? grad{i}" for i in range(d.num_outputs))
    inputs = ", ".join(f"{t} {n}" for n, t in d.flat_params())
    saved = "".join(f", Tensor out{i}" for i in range(d.num_outputs)) if d.saves_outputs else ""
    n = len(d.grad_args)
    outs = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({grads}, {inputs}{saved}, str backend) -> {outs}"


def _register_autograd(d: OpDecl, op: Any) -> None:
    n_out, n_in = d.num_outputs, len(d.flat_params())
    n_saved = n_out if d.saves_outputs else 0
    tensor_at = [i for i, (_, t) in enumerate(d.flat_params()) if t.startswith("Tensor")]
    grad_at = {i for i, (n, _) in enumerate(d.flat_params()) if n in d.grad_args}

    def backward_impl(*flat: Any) -> Any:
        grads, inputs = flat[:n_out], flat[n_out : n_out + n_in]
        outputs = flat[n_out + n_in : n_out + n_in + n_saved] or (None,) * n_out
        key, args = flat[-1], d.unflatten(inputs)
        if d.before_backward is not None:
            args, outputs, grads = d.before_backward(lambda a: _run(key, d.name, a), args, outputs, grads)
        out = run_backward(key, d.name, args, tuple(outputs), tuple(grads))
        return out[0] if len(out) == 1 else out

    def backward_fake(*flat: Any) -> Any:
        args = d.unflatten(flat[n_out : n_out + n_in], fake=True)
        out = tuple(torch.empty_like(args[n]) for n in d.grad_args)
        return out[0] if len(out) == 1 else out

    name = f"{d.name}_backward"
    schema = backward_schema(d)
    bop = torch.library.custom_op(f"{NAMESPACE}::{name}", backward_impl, mutates_args=(), schema=schema)
    bop.register_fake(backward_fake)
    _check_schema(bop, d, schema, name)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outs = (output,) if n_out == 1 else tuple(output)
        ctx.save_for_backward(*(inputs[i] for i in tensor_at), *(outs if d.saves_outputs else ()))
        ctx.inputs = tuple(None if i in tensor_at else v for i, v in enumerate(inputs))
        for i in d.nondiff_outputs:
            ctx.mark_non_differentiable(outs[i])

    def backward(ctx: Any, *grads: Any) -> tuple:
        saved = ctx.saved_tensors
        inputs = list(ctx.inputs)
        for i, t in zip(tensor_at, saved, strict=False):
            inputs[i] = t
        outputs = saved[len(tensor_at) :]
        got = bop(*grads, *inputs[:-1], *outputs, inputs[-1])
        got = iter((got,) if len(d.grad_args) == 1 else got)
        return tuple(next(got) if i in grad_at else None for i in range(n_in + 1))

    op.register_autograd(backward, setup_context=setup_context)

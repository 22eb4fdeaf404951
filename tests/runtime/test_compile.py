"""The model compiles: prefill and a paged decode step trace with zero graph breaks on the reference
backend (every contract op is one opaque custom-op node), and the compiled step gives eager's tokens."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM


@pytest.fixture(scope="module")
def model():
    cfg = GLM5Config.from_preset("tiny")
    return GLM5ForCausalLM(cfg, "reference").eval()


def _explain(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(fn)(*args)
    reasons = [f"{b.reason[:200]} at {b.user_stack[-1] if b.user_stack else '?'}" for b in ex.break_reasons]
    return ex.graph_break_count, reasons


def test_prefill_has_no_graph_breaks(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    breaks, reasons = _explain(model, ids)
    assert breaks == 0, reasons


@pytest.mark.parametrize("block_size", [None, 16], ids=["ragged", "paged"])
def test_decode_step_has_no_graph_breaks(model, block_size):
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    cache = model.new_cache(2, 128, block_size=block_size)
    with torch.no_grad():
        model(ids, cache)
    breaks, reasons = _explain(model, ids[:, :1], cache)
    assert breaks == 0, reasons


def test_compiled_decode_matches_eager(model):
    torch._dynamo.reset()
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    eager_cache = model.new_cache(2, 128, block_size=16)
    comp_cache = model.new_cache(2, 128, block_size=16)
    # aot_eager: the whole graph through AOT autograd and functionalization, without inductor codegen
    # (minutes on a small CI machine); bench/bench_dispatch.py times the inductor-compiled step
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        model(ids, eager_cache)
        model(ids, comp_cache)
        tok_e = tok_c = ids[:, -1:]
        for _ in range(3):
            tok_e = model(tok_e, eager_cache).logits[:, -1].argmax(-1, keepdim=True)
            out = step(tok_c, comp_cache).logits
            tok_c = out[:, -1].argmax(-1, keepdim=True)
            assert torch.equal(tok_e, tok_c)


def test_a_non_differentiable_op_gives_no_gradient_on_either_path():
    """topk has no backward in the contract: its values carry no gradient, whether the front door takes the
    eager fast path or the custom op (what a compiled graph runs)."""
    import backends

    be = backends.get("reference")
    x = torch.randn(3, 10, requires_grad=True)
    eager, _ = be.topk(x, 2)
    traced, _ = torch.compile(lambda t: be.topk(t, 2), fullgraph=True, backend="aot_eager")(x)
    assert not eager.requires_grad and not traced.requires_grad

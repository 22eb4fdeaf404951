"""The routed experts are trained: gradients flow through grouped_matmul (SPEC 2.8) to the stacked
expert weights and back to the hidden states, as a plain float64 per-token oracle computes them, and an
optimizer step moves the experts of the tiny model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import backends
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.core.moe import Experts


def _oracle(x, ids, w, ex: Experts):
    """sum_j w[t, j] * down(silu(gate(x_t)) * up(x_t)) of expert ids[t, j], token by token, float64."""
    rows = []
    for t in range(x.shape[0]):
        acc = 0.0
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = nn.functional.silu(ex.gate_proj[e] @ x[t]) * (ex.up_proj[e] @ x[t])
            acc = acc + w[t, j] * (ex.down_proj[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_expert_gradients_match_a_per_token_oracle(backend):
    g = torch.Generator().manual_seed(0)
    n, d, inter, t, k = 6, 16, 8, 7, 2
    ex = Experts(n, d, inter)
    for p in ex.parameters():
        nn.init.normal_(p, std=0.3, generator=g)
    ids = torch.stack([torch.randperm(n - 1, generator=g)[:k] for _ in range(t)]).to(torch.int32)  # n-1: none
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, d, generator=g, requires_grad=True)
    dy = torch.randn(t, d, generator=g)
    ex(x, ids, w, backends.get(backend)).backward(dy)

    ex64 = Experts(n, d, inter, dtype=torch.float64)
    ex64.load_state_dict({k_: v.double() for k_, v in ex.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    _oracle(x64, ids, w.double(), ex64).backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    for name, p in ex.named_parameters():
        torch.testing.assert_close(p.grad.double(), getattr(ex64, name).grad, rtol=1e-5, atol=1e-5)
        assert not p.grad[n - 1].any(), name  # the expert no token chose


def test_an_optimizer_step_moves_the_routed_experts_of_the_tiny_model():
    cfg = GLM5Config.from_preset("tiny")
    model = GLM5ForCausalLM(cfg, backend="cpu")
    model.init_weights(0)
    model.train()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids, return_logits=False).loss.backward()
    decoder = [f"model.layers.{i}.mlp.experts." for i in range(cfg.num_hidden_layers)]  # not the MTP layer
    experts = {n: p for n, p in model.named_parameters() if n.startswith(tuple(decoder))}
    assert len(experts) == 3 * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
    for name, p in experts.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    before = {n: p.detach().clone() for n, p in experts.items()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for name, p in experts.items():
        assert not torch.equal(p.detach(), before[name]), name

"""Expert parallel on the dispatch (SPEC 11.1) in the whole model, 2 gloo ranks: experts across ranks that
hold different tokens (data-parallel ranks, `ep_tokens="local"`: training's `dp=2,ep=2`) against one
process on each rank's tokens (logits bitwise on the reference backend, loss and every gradient; the
layout-invariant mode's bits), and the masked decode mode (bitwise with room, drops counted without);
`ep_tokens="tp"` with the two ranks as one tensor-parallel group (the layout-invariant mode's bits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup
from glm5.parallel.invariant import layout_invariant
from tests.ranks import run_ranks


def _model() -> GLM5ForCausalLM:
    torch.manual_seed(0)
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    m.init_weights(0)
    return m


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(100 + rank))


def _step(model: GLM5ForCausalLM, ids: torch.Tensor):
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _experts(model):
    return [m for m in model.modules() if isinstance(m, plan.ExpertParallel)]


def _rank(rank: int, world: int) -> dict:
    out = {}
    model = _model()
    shards = plan.apply(model, tp=Single(), ep=TorchGroup(), ep_tokens="local")
    out["train"] = (*_step(model, _ids(rank)), {n: (s.dim, s.start, s.length) for n, s in shards.items()})
    for name, capacity in (("room", 2 * 24), ("tight", 1)):
        model = _model()
        plan.apply(model, tp=Single(), ep=TorchGroup(), ep_tokens="local", ep_capacity=capacity)
        with torch.no_grad():
            logits = model(_ids(rank)).logits
        out[name] = (logits, sum(int(e.ep_dropped) for e in _experts(model)))
    model = _model()
    plan.apply(model, tp=Single(), ep=TorchGroup(), ep_tokens="local")
    with torch.no_grad(), layout_invariant(model.backend):
        out["invariant"] = model(_ids(rank)).logits
    # "tp": the ranks as one tensor-parallel group (the same tokens: one data-parallel rank's of vLLM's
    # DP x TP), each dispatching its chunk over the expert group, the outputs gathered over tp
    model = _model()
    plan.apply(model, tp=TorchGroup(), ep=TorchGroup(), ep_tokens="tp")
    assert all(e.ep_copies is not None and e.ep_copies.size == 2 for e in _experts(model))
    with torch.no_grad(), layout_invariant(model.backend):
        out["invariant_tp"] = model(_ids(0)).logits
    return out


def test_experts_across_ranks_with_their_own_tokens_match_one_process():
    results = run_ranks(_rank, 2)
    singles = [_step(_model(), _ids(r)) for r in range(2)]
    for rank, r in enumerate(results):
        logits, loss, grads, shards = r["train"]
        ref_logits, ref_loss, ref_grads = singles[rank]
        assert torch.equal(logits, ref_logits)  # each slot computed once, combined in slot order
        assert torch.equal(loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            if name in shards:  # a rank's experts: the gradient of both ranks' tokens routed to them
                dim, start, length = shards[name]
                want = sum(s[2][name] for s in singles).narrow(dim, start, length)
            else:  # replicated: this rank's tokens only (data parallel averages them afterwards)
                want = ref_grads[name]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7, msg=name)
        # masked mode: with room for every pair the contiguous bits, nothing dropped
        assert torch.equal(r["room"][0], ref_logits) and r["room"][1] == 0
        # one row per expert and source rank: slots drop, are counted, and the output moves
        assert r["tight"][1] > 0
        assert not torch.equal(r["tight"][0], ref_logits)
        # the layout-invariant mode (SPEC 12) across this layout: one process's bits in the mode
        model = _model()
        with torch.no_grad(), layout_invariant(model.backend):
            assert torch.equal(r["invariant"], model(_ids(rank)).logits)
            assert torch.equal(r["invariant_tp"], model(_ids(0)).logits)


def test_plan_refuses_a_bad_expert_layout_in_one_line():
    class Two:
        rank, size = 0, 2

    with pytest.raises(
        plan.PlanError, match=r"^ep_tokens: expected 'replicated', 'local' or 'tp', got 'dp'$"
    ):
        plan.apply(_model(), tp=Single(), ep=Two(), ep_tokens="dp")
    with pytest.raises(
        plan.PlanError, match=r"^ep_tokens: 'tp' needs an expert group of whole tp groups, go"
    ):
        plan.apply(_model(), tp=Two(), ep=SimpleNamespace(rank=0, size=3), ep_tokens="tp")
    with pytest.raises(plan.PlanError, match=r"^ep_capacity: expected an integer >= 1 or None, got 0$"):
        plan.apply(_model(), tp=Single(), ep=Two(), ep_capacity=0)

    class Three:
        rank, size = 0, 3

    with pytest.raises(plan.PlanError, match=r"^n_routed_experts: 8 does not split over 3 ranks$"):
        plan.apply(_model(), tp=Single(), ep=Three())


class _Steps:
    """A host's own steps (as a DeepEP / MC2 host would give): the reference's, counted."""

    def __init__(self) -> None:
        from backends.moe import expert_parallel as expert_dispatch

        self.ref, self.calls, self.capacities = expert_dispatch, [], []

    def layout(self, ids, n_experts):
        self.calls.append("layout")
        return self.ref.layout(ids, n_experts)

    def dispatch(self, x, lay, group, capacity=None):
        self.calls.append("dispatch")
        self.capacities.append(capacity)
        return self.ref.dispatch(x, lay, group, capacity)

    def combine(self, ys, weights, h, group):
        self.calls.append("combine")
        return self.ref.combine(ys, weights, h, group)


def test_a_group_with_its_own_expert_steps_runs_them():
    class Alone:  # a 1-rank expert group: every expert here, its exchange the identity
        rank, size = 0, 1

        def all_to_all(self, x, send, recv):
            return x

    group = Alone()
    group.expert_steps = _Steps()
    model = _model()
    plan._expert_parallel(model.model.layers[1].mlp.experts, group, "local", None, None)
    with torch.no_grad():
        got = model(_ids(0)).logits
        want = _model()(_ids(0)).logits
    assert group.expert_steps.calls == ["layout", "dispatch", "combine"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("masked_tokens, capacity", [(48, 48), (47, None)])
def test_steps_up_to_the_decode_bound_take_the_masked_dispatch(masked_tokens, capacity):
    # replicated tokens (a serving engine's TP = EP): a step of at most `ep_masked_tokens` per rank is
    # dispatched masked with that capacity (nothing can overflow, nothing read back), a larger one contiguous
    class Alone:
        rank, size = 0, 1

        def all_to_all(self, x, send, recv):
            return x

        def all_gather(self, x, dim):
            return x

    group = Alone()
    group.expert_steps = _Steps()
    model = _model()
    plan._expert_parallel(model.model.layers[1].mlp.experts, group, "replicated", None, masked_tokens)
    with torch.no_grad():
        got = model(_ids(0)).logits  # 2 x 24 = 48 tokens
        want = _model()(_ids(0)).logits
    assert group.expert_steps.capacities == [capacity]
    assert torch.equal(got, want)

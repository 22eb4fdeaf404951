"""The layout-invariant mode (SPEC 12) on the dispatched expert parallel (SPEC 11.1) and on MTP drafts, on
the tie-heavy tiny model of test_invariant_layouts, 2 gloo ranks, reference and cpu backends:

- data-parallel attention with experts dispatched across the ranks (`ep_tokens="local"`, each rank its own
  half of the batch): logits, per-layer top-k sets and MTP draft logits are the unsplit model's bits on
  the rank's rows, in the contiguous dispatch (prefill) and the masked one (`ep_capacity`, prefill then
  decode, nothing dropped); the same masked comparison fails in the normal mode (its decode moves low bits
  against its prefill). The normal mode's contiguous prefill happens to match here too (this CPU's fp32
  GEMM gives a row the same bits at 2 and 4 rows): that is the BLAS's behaviour, not a construction;
- replicated tokens (tp=Single, ep=2) in the masked mode (`ep_masked_tokens`; the contiguous one is
  test_invariant_layouts' "ep");
- MTP drafts at TP 2 (+ EP 2) and batch 1 vs 4 are the unsplit bits; the normal mode's TP 2 drafts differ."""

from __future__ import annotations

import pytest
import torch

from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup
from glm5.parallel.invariant import layout_invariant
from tests.glm5.test_invariant_layouts import _decoded, _ids, _model, _nullctx, _same
from tests.ranks import run_ranks

BACKENDS = ("reference", "cpu")
S, PREFIX = 24, 20  # the first 24 tokens of _ids (index_topk 16: sparse); prefill 20, then 4 decode steps


def _short() -> torch.Tensor:
    return _ids()[:, :S]


@torch.no_grad()
def _with_draft(model, ids, invariant: bool):
    """(logits, per-layer top-k, MTP depth-0 draft logits): slot i of the draft reads token i+1 and the
    main model's hidden state at i."""
    with layout_invariant(model.backend) if invariant else _nullctx():
        out = model(ids, return_topk=True)
        draft = model.mtp_forward(ids[:, 1:], out.hidden_states[:, :-1]).logits
    return out.logits, [t.clone() for t in out.topk], draft


class _Capacities:
    """The reference's dispatch steps (backends/moe/expert_parallel.py) as a host's `expert_steps`, recording
    each dispatch's capacity (None: the contiguous mode), so a test sees which mode ran."""

    def __init__(self) -> None:
        from backends.moe import expert_parallel as expert_dispatch

        self.ref, self.seen = expert_dispatch, set()

    def layout(self, ids, n_experts):
        return self.ref.layout(ids, n_experts)

    def dispatch(self, x, lay, group, capacity=None):
        self.seen.add(capacity)
        return self.ref.dispatch(x, lay, group, capacity)

    def combine(self, ys, weights, h, group):
        return self.ref.combine(ys, weights, h, group)


def _group() -> TorchGroup:
    g = TorchGroup()
    g.expert_steps = _Capacities()
    return g


def _dropped(model) -> int:
    return sum(int(m.ep_dropped) for m in model.modules() if isinstance(m, plan.ExpertParallel))


def _rank(rank: int, world: int, backend: str) -> dict:
    ids, out = _short(), {}
    mine = ids[2 * rank : 2 * rank + 2]  # data parallel: each rank holds its own half of the batch
    model, g = _model(backend), _group()
    plan.apply(model, tp=Single(), ep=g, ep_tokens="local")  # contiguous dispatch
    out["dp"] = _with_draft(model, mine, True)
    out["dp capacities"] = g.expert_steps.seen
    model, g = _model(backend), _group()
    # masked dispatch, room for every pair of the prefill (2 x PREFIX tokens per rank) and each decode step
    plan.apply(model, tp=Single(), ep=g, ep_tokens="local", ep_capacity=2 * PREFIX)
    out["dp masked"] = _decoded(model, mine, PREFIX, True)
    out["dp masked normal"] = _decoded(model, mine, PREFIX, False)
    out["dp masked dropped"], out["dp masked capacities"] = _dropped(model), g.expert_steps.seen
    model, g = _model(backend), _group()
    plan.apply(model, tp=Single(), ep=g, ep_masked_tokens=ids.numel() // 2)  # each rank's chunk: masked
    out["replicated masked"] = _with_draft(model, ids, True)
    out["replicated masked capacities"] = g.expert_steps.seen
    out["replicated masked dropped"] = _dropped(model)
    model, g = _model(backend), TorchGroup()
    plan.apply(model, tp=g, ep=g)
    out["tp"] = _with_draft(model, ids, True)
    out["tp normal draft"] = _with_draft(model, ids, False)[2]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatched_ep_and_mtp_drafts_are_the_unsplit_bits_and_the_normal_mode_is_not(backend):
    model, ids = _model(backend), _short()
    logits, topk, draft = _with_draft(model, ids, True)
    logits_normal, _, draft_normal = _with_draft(model, ids, False)
    one = _with_draft(model, ids[2:3], True)  # batch 1 vs 4, the draft included
    assert torch.equal(one[0][0], logits[2]) and torch.equal(one[2][0], draft[2])
    results = run_ranks(_rank, 2, backend)
    for rank, r in enumerate(results):
        rows, toks = slice(2 * rank, 2 * rank + 2), slice(2 * rank * S, (2 * rank + 2) * S)
        mine = (logits[rows], [t[toks] for t in topk])
        assert r["dp capacities"] == {None}
        assert r["dp masked capacities"] == {2 * PREFIX} and r["replicated masked capacities"] == {S * 2}
        assert _same(r["dp"][:2], mine) and torch.equal(r["dp"][2], draft[rows])
        assert _same(r["dp masked"], mine) and r["dp masked dropped"] == 0
        # the same comparison in the normal mode fails: its decode steps move low bits against its prefill
        assert not torch.equal(r["dp masked normal"][0], logits_normal[rows])
        assert _same(r["replicated masked"][:2], (logits, topk))
        assert torch.equal(r["replicated masked"][2], draft) and r["replicated masked dropped"] == 0
        assert _same(r["tp"][:2], (logits, topk)) and torch.equal(r["tp"][2], draft)
        assert not torch.equal(r["tp normal draft"], draft_normal)  # the row-parallel float sum

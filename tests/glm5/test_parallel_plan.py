"""The one parallel plan (glm5/parallel/plan.py) on 2 gloo ranks: tensor parallel against the unsplit model,
expert parallel bitwise, the vocabulary-split embedding bitwise, and loader slicing."""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.parallel import plan
from glm5.parallel.group import Single, TorchGroup
from glm5.train.loop.dsa import AttentionProbe
from tests.ranks import run_ranks

BACKENDS = ("reference", "cpu")


def _model(backend: str) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend=backend)
    m.init_weights(0)
    return m


def _ids() -> torch.Tensor:
    # 40 tokens per row: more keys than index_topk (16), so the indexer selects
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


def _forward_and_grads(model: GLM5ForCausalLM):
    """Logits, loss (LM + the sparse stage's indexer KL, whose teacher sums attention over every rank's
    heads), per-layer top-k and every gradient."""
    ids = _ids()
    probe = AttentionProbe(model, stage="sparse")
    out = model(ids, labels=ids, return_topk=True)
    loss = out.loss + probe.kl_loss()
    out.logits.float().sum().mul(0).add(loss).backward()
    out.loss = loss
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), [t.clone() for t in out.topk], grads


def _layouts_rank(rank: int, world: int, backend: str) -> dict:
    """One process launch for every layout: tp, tp + ep (gradients), ep alone (logits)."""
    out = {}
    for ep in (False, True):
        model = _model(backend)
        group = TorchGroup()
        shards = plan.apply(model, tp=group, ep=group if ep else None)
        logits, loss, topk, grads = _forward_and_grads(model)
        out["tp+ep" if ep else "tp"] = (
            logits,
            loss,
            topk,
            grads,
            {n: (s.dim, s.start, s.length) for n, s in shards.items()},
        )
    model = _model(backend)
    plan.apply(model, tp=Single(), ep=TorchGroup())
    with torch.no_grad():
        out["ep"] = model(_ids()).logits
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_and_expert_parallel_match_the_unsplit_model(backend):
    ref_logits, ref_loss, ref_topk, ref_grads = _forward_and_grads(_model(backend))
    results = run_ranks(_layouts_rank, 2, backend)
    # expert parallel alone (attention unsplit): each (token, slot) output has one owner, so the sum over
    # ranks is exact and the logits are the unsplit model's bits wherever a grouped_matmul row does not
    # depend on how many rows its expert has (the backend's batch_invariant claim); the cpu backend's
    # float GEMMs block by the rows of each expert, so there only a tolerance follows by construction
    with torch.no_grad():
        model = _model(backend)
        unsplit = model(_ids()).logits
    exact = model.backend.capabilities("grouped_matmul").batch_invariant
    for r in results:
        if exact:
            assert torch.equal(r["ep"], unsplit)
        else:
            torch.testing.assert_close(r["ep"], unsplit, rtol=1e-5, atol=1e-5)
    for layout in ("tp", "tp+ep"):
        ranks = [r[layout] for r in results]
        for logits, loss, topk, grads, shards in ranks:
            # the same top-k as the unsplit run, up to a near-tie (past layer 0 the indexer's input went
            # through row-parallel sums); across ranks they are equal by construction (checked below)
            for a, b in zip(topk, ref_topk, strict=True):
                assert (a == b).float().mean() > 0.95
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            assert set(grads) == set(ref_grads)
            for name, g in grads.items():
                full = ref_grads[name]
                if name in shards:
                    dim, start, length = shards[name]
                    full = full.narrow(dim, start, length)
                torch.testing.assert_close(g, full, rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")
        # the two ranks' logits and top-k are the same bits (fixed-order sums, replicated indexer)
        assert torch.equal(ranks[0][0], ranks[1][0])
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][2], ranks[1][2], strict=True))
        halves = [sum(v[2] for n, v in r[4].items()) for r in ranks]
        assert halves[0] == halves[1] > 0


def test_plan_slices_parameters_and_refuses_what_does_not_split():
    model = _model("reference")

    class Three:  # a group of 3 ranks: 4 heads do not split
        rank, size = 0, 3

        def all_reduce(self, x):
            return x

        def all_gather(self, x, dim):
            return x

    with pytest.raises(plan.PlanError, match="num_attention_heads: 4 does not split over 3 ranks"):
        plan.apply(model, tp=Three())
    assert model.model.layers[0].self_attn.q_b_proj.weight.shape == (4 * 24, 48)  # refused before any split
    assert getattr(model, "glm5_plan", None) is None


def test_local_slice_on_a_meta_model_gives_each_rank_its_part():
    full = _model("reference")

    class Second:
        rank, size = 1, 2

        def all_reduce(self, x):
            return x

        def all_gather(self, x, dim):
            return x

    with torch.device("meta"):
        meta = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    shards = plan.apply(meta, tp=Second())
    sd = full.state_dict()
    name = "model.layers.0.self_attn.q_b_proj.weight"
    info = shards[name]
    assert (info.kind, info.dim, info.rank, info.size) == ("heads", 0, 1, 2)
    assert meta.get_parameter(name).shape == (2 * 24, 48)  # 2 of 4 heads, 24 rows each
    assert torch.equal(plan.local_slice(meta, name, sd[name]), sd[name][48:])
    assert plan.local_slice(meta, "model.norm.weight", sd["model.norm.weight"]) is sd["model.norm.weight"]
    with pytest.raises(plan.PlanError, match="expected the full shape"):
        plan.local_slice(meta, name, sd[name][:3])


def _quantized(recipe: str) -> GLM5ForCausalLM:
    from quant.quantize import quantize_model

    model = _model("reference")
    quantize_model(model, recipe)
    return model.eval()


def _quant_rank(rank: int, world: int, recipe: str) -> dict:
    out = {}
    for layout in ("ep", "tp", "tp+ep"):
        model = _quantized(recipe)
        group = TorchGroup()
        plan.apply(model, tp=Single() if layout == "ep" else group, ep=group if layout != "tp" else None)
        out[layout] = _first_layer_and_logits(model)
    return out


def _first_layer_and_logits(model: GLM5ForCausalLM):
    seen = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out[0]) and None)
    with torch.no_grad():
        return model(_ids()).logits, seen[0]


@pytest.mark.parametrize("recipe", ["glm5-w8a8", "glm5-w4a8"])
def test_quantized_layers_split_by_the_same_plan(recipe):
    """W8A8 / W4A8 linears and experts declare their own split (`parallel_split`): expert parallel is the
    unsplit quantized model's bits; tensor parallel quantizes each rank's half of a row-parallel input with
    its own per-token scale (as vLLM does), so it is close, not equal: compared on the first layer's output,
    before a near-tie of the random tiny model's indexer can move a top-k set and amplify the difference."""
    ref_logits, ref_layer0 = _first_layer_and_logits(_quantized(recipe))
    results = run_ranks(_quant_rank, 2, recipe)
    for r in results:
        assert torch.equal(r["ep"][0], ref_logits)
    for layout in ("tp", "tp+ep"):
        for _, layer0 in (r[layout] for r in results):
            err = (layer0 - ref_layer0).abs().max().item()
            assert 0 < err < 0.02 * ref_layer0.abs().max().item(), (layout, err)

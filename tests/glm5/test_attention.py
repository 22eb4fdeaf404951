"""DSA attention layer against independent float64 oracles (tests/glm5/_util.py)."""

import pytest
import torch

from tests.glm5._util import indexer_scores, make_model, mla_dense, topk_mask

TOPK = 16  # the tiny preset's index_topk


def _layer_io(model, layer: int, t: int, seed: int = 1):
    attn = model.model.layers[layer].self_attn
    x = torch.randn(t, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    step = model.begin_step([t], None)
    return attn, x, step, torch.arange(t)


@pytest.mark.parametrize("interleave", [True, False])
def test_at_most_topk_keys_equals_dense_causal(interleave):
    model = make_model(indexer_rope_interleave=interleave)
    attn, x, step, pos = _layer_io(model, 1, TOPK)
    with torch.no_grad():
        out, topk = attn(x, step, None)
    dense = mla_dense(attn, model.config, x, pos, torch.ones(TOPK, TOPK, dtype=torch.bool).tril())
    torch.testing.assert_close(out.double(), dense, rtol=1e-5, atol=1e-6)
    # every causal key selected, nothing else
    assert all(set(row[row >= 0].tolist()) == set(range(i + 1)) for i, row in enumerate(topk))


@pytest.mark.parametrize("interleave", [True, False])
def test_more_keys_than_topk_is_sparse_and_masked_dense(interleave):
    model = make_model(indexer_rope_interleave=interleave)
    t = 3 * TOPK + 5
    attn, x, step, pos = _layer_io(model, 1, t)
    with torch.no_grad():
        out, topk = attn(x, step, None)
    cfg = model.config
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    selected = topk_mask(indexer_scores(attn, cfg, x, pos), TOPK)
    got = torch.zeros(t, t, dtype=torch.bool)
    for i, row in enumerate(topk):
        got[i, row[row >= 0].long()] = True
    assert torch.equal(got, selected), "indexer selection differs from the independent top-k"
    assert (selected.sum(1) == torch.clamp(torch.arange(t) + 1, max=TOPK)).all()
    dense = mla_dense(attn, cfg, x, pos, causal)
    masked = mla_dense(attn, cfg, x, pos, selected)
    torch.testing.assert_close(out.double(), masked, rtol=1e-5, atol=1e-6)
    late = slice(TOPK, None)  # rows with more causal keys than top-k must differ from dense
    assert (out.double()[late] - dense[late]).abs().amax() > 1e-3


def test_indexer_rope_layout_changes_selection():
    """A wrong RoPE layout (the GLM-5 vs DeepSeek-V3.2 trap) must change which keys are chosen."""
    a, b = make_model(indexer_rope_interleave=True), make_model(indexer_rope_interleave=False)
    t = 4 * TOPK
    sel = []
    for m in (a, b):
        attn, x, step, _ = _layer_io(m, 0, t)
        with torch.no_grad():
            sel.append(attn(x, step, None)[1])
    assert not torch.equal(sel[0], sel[1])


def test_shared_layer_attends_to_given_selection(tiny):
    cfg = tiny.config
    assert cfg.indexer_types == ["full", "full", "shared", "full"]
    t = 3 * TOPK
    attn, x, step, pos = _layer_io(tiny, 2, t)
    assert attn.indexer is None
    prev = tiny.model.layers[1].self_attn
    with torch.no_grad():
        chosen = prev.indexer(x, prev.project(x, step)[2], prev.indexer.keys(x, step), step)
        out, used = attn(x, step, chosen)
    assert used is chosen
    allowed = torch.zeros(t, t, dtype=torch.bool)
    for i, row in enumerate(chosen):
        allowed[i, row[row >= 0].long()] = True
    torch.testing.assert_close(out.double(), mla_dense(attn, cfg, x, pos, allowed), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shared_topk"):
        attn(x, step, None)


def test_model_shared_layers_reuse_previous_full_selection(tiny):
    ids = torch.randint(0, 512, (2, 3 * TOPK), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = tiny(ids, return_topk=True)
    full1, shared2, full3 = out.topk[1], out.topk[2], out.topk[3]
    assert shared2 is full1
    assert not torch.equal(full3, full1)  # full layers select on their own
    names = [n for n, _ in tiny.named_parameters()]
    assert not any(n.startswith("model.layers.2.self_attn.indexer") for n in names)
    assert any(n.startswith("model.layers.3.self_attn.indexer") for n in names)

import math

import pytest
import torch

from glm5.train.loop.state import _flatten, _unflatten
from glm5.train.muon.optimizer import Blocks, Muon, blocks_for, build_optimizers, zeropower_via_newtonschulz
from tests.glm5._util import make_model


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 32)])
def test_newton_schulz_orthogonalises(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = zeropower_via_newtonschulz(g)
    assert o.shape == g.shape
    sv = torch.linalg.svdvals(o.double())
    # the quintic iteration trades exactness for speed: singular values land near 1, not on it
    assert sv.min() > 0.5 and sv.max() < 1.5
    # same singular vectors as g: o is the polar factor up to that per-direction scale
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    core = u.mT @ o.double() @ vh.mT
    off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-4


def test_batched_equals_one_matrix_at_a_time():
    g = torch.randn(4, 8, 20, generator=torch.Generator().manual_seed(1))
    batched = zeropower_via_newtonschulz(g)
    single = torch.stack([zeropower_via_newtonschulz(m) for m in g])
    torch.testing.assert_close(batched, single)


def test_whole_matrix_muon_matches_torch_optim_muon():
    # torch.optim.Muon (2-D only, bf16 iteration) with Moonlight's RMS matching is our whole-matrix case
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(24, 40, generator=gen)
    grads = [torch.randn(24, 40, generator=gen) for _ in range(3)]
    a = torch.nn.Parameter(w0.clone())
    b = torch.nn.Parameter(w0.clone())
    ours = Muon([{"params": [a], "blocks": [Blocks(1, (24,))]}], lr=0.02, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([b], lr=0.02, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        for p, opt in ((a, ours), (b, ref)):
            p.grad = g.clone()
            opt.step()
    step = 0.02 * 0.2 * math.sqrt(40)  # one update's scale; bf16 iterations differ in rounding only
    assert (a - b).abs().max() < 0.05 * step
    assert (a - w0).abs().max() > step / 2  # it moved


def test_split_orthogonalises_each_head_block_with_rms_matching():
    model = make_model()
    cfg = model.config
    p = model.model.layers[0].self_attn.kv_b_proj.weight
    blk = blocks_for("model.layers.0.self_attn.kv_b_proj.weight", p, cfg, split=True)
    assert blk == Blocks(cfg.num_attention_heads, (cfg.qk_nope_head_dim, cfg.v_head_dim))
    opt = Muon([{"params": [p], "blocks": [blk]}])
    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
    u = opt.update(g, blk, 5).view(cfg.num_attention_heads, -1, p.shape[1])
    n = cfg.qk_nope_head_dim
    for part, rows in ((u[:, :n], n), (u[:, n:], cfg.v_head_dim)):
        sv = torch.linalg.svdvals(part.double()) / (0.2 * math.sqrt(max(rows, p.shape[1])))
        assert sv.min() > 0.5 and sv.max() < 1.5  # W_UK_h, W_UV_h each orthogonalised on its own
        rms = part.pow(2).mean().sqrt()
        assert 0.12 < rms < 0.3  # ~0.2: AdamW-like update RMS
    whole = opt.update(g, Blocks(1, (p.shape[0],)), 5)
    assert not torch.allclose(whole, u.reshape(p.shape), atol=1e-3)
    q = model.model.layers[0].self_attn.q_b_proj.weight
    assert blocks_for("x.self_attn.q_b_proj.weight", q, cfg, True) == Blocks(4, (cfg.qk_head_dim,))
    assert blocks_for("x.self_attn.q_b_proj.weight", q, cfg, False) == Blocks(1, (q.shape[0],))


def test_parameter_split_between_muon_and_adamw():
    model = make_model()
    muon, adamw = build_optimizers(model, "muon-split")
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for p in muon.param_groups[0]["params"]}
    in_adam = {names[id(p)] for p in adamw.param_groups[0]["params"]}
    assert not in_muon & in_adam
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert in_muon | in_adam == trainable
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= in_adam
    assert all(model.get_parameter(n).dim() >= 2 for n in in_muon)
    assert "model.layers.1.mlp.experts.gate_proj" in in_muon
    assert not any(n.endswith("e_score_correction_bias") for n in in_muon | in_adam)
    (only,) = build_optimizers(model, "adamw")
    assert isinstance(only, torch.optim.AdamW)
    with pytest.raises(ValueError, match="mode"):
        build_optimizers(model, "sgd")


def test_state_roundtrip_through_json_and_safetensors_layout_is_exact():
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(8, 12, generator=gen) for _ in range(4)]

    def fresh():
        p = torch.nn.Parameter(torch.ones(8, 12))
        return p, Muon([{"params": [p], "blocks": [Blocks(2, (4,))]}], lr=0.01)

    p1, o1 = fresh()
    for g in grads:
        p1.grad = g.clone()
        o1.step()
    p2, o2 = fresh()
    for g in grads[:2]:
        p2.grad = g.clone()
        o2.step()
    tensors: dict = {}
    import json

    meta = json.loads(json.dumps(_flatten(o2.state_dict(), tensors, "opt")))
    p3, o3 = fresh()
    with torch.no_grad():
        p3.copy_(p2)
    o3.load_state_dict(_unflatten(meta, tensors))
    for g in grads[2:]:
        p3.grad = g.clone()
        o3.step()
    assert torch.equal(p1, p3)

import torch

from glm5.train.loop.dsa import AttentionProbe, ExpertBalancer, kl_rows
from glm5.train.muon.optimizer import build_optimizers
from tests.glm5._util import make_model, random_ids

# 32 keys per request against index_topk 16: the sparse set is a strict subset of the causal keys
IDS = random_ids(2, 32, vocab=256, seed=8)


def test_kl_rows():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    assert torch.allclose(kl_rows(p, p.clamp_min(1e-30).log(), valid), torch.zeros(2), atol=1e-6)
    q = torch.tensor([[0.9, 0.1, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    kl = kl_rows(p, q.clamp_min(1e-30).log(), valid)
    want = (p * (p / q).log()).nan_to_num().sum(-1)
    torch.testing.assert_close(kl, want)
    assert (kl > 0).all()


def _kl(model, stage, ids=IDS):
    probe = AttentionProbe(model, stage=stage)
    try:
        model(ids, return_logits=False)
        return probe.kl_loss(), probe
    finally:
        probe.remove()


def test_sparse_kl_equals_dense_kl_when_topk_covers_every_key():
    model = make_model(index_topk=64)  # more than the 32 keys: the selected set is every causal key
    dense, _ = _kl(model, "warmup")
    sparse, _ = _kl(model, "sparse")
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-7)
    small = make_model()  # index_topk 16 < 32 keys: restricted to the selected set, a different value
    assert not torch.allclose(_kl(small, "sparse")[0], _kl(small, "warmup")[0])


def test_kl_trains_only_the_indexer_and_lm_loss_never_does():
    model = make_model()
    kl, probe = _kl(model, "sparse")
    kl.backward()
    for name, p in model.named_parameters():
        has = p.grad is not None and bool(p.grad.abs().sum() > 0)
        # layer 2 is 'shared' in the tiny pattern (no indexer); layer 4, the MTP layer, did not run
        if ".indexer." in name and "layers.4." not in name:
            assert has or name.endswith("k_norm.bias"), name
        else:
            assert not has, name
    model.zero_grad(set_to_none=True)
    model(IDS, labels=IDS, return_logits=False).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    assert len(probe.max_logits) == model.config.num_hidden_layers
    assert all(0 < m < 100 for m in probe.max_logits)


def test_warmup_lowers_the_dense_kl_with_the_base_frozen():
    model = make_model()
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." in name)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." not in n}
    opts = build_optimizers(model, "muon-split", lr=1e-2, weight_decay=0.0)
    probe = AttentionProbe(model, stage="warmup")
    kls = []
    for _ in range(8):
        probe.reset()
        model(IDS, return_logits=False)
        kl = probe.kl_loss()
        kls.append(float(kl.detach()))
        kl.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    assert kls[-1] < 0.8 * kls[0], kls
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_balancer_moves_bias_against_load():
    model = make_model()
    bal = ExpertBalancer(model, gamma=0.01)
    before = [r.e_score_correction_bias.clone() for r in bal.routers]
    with torch.no_grad():
        model(IDS)
    loads = [load.clone() for load in bal.load]
    viol = bal.update()
    assert viol > 0
    for r, b0, load in zip(bal.routers, before, loads):
        delta = r.e_score_correction_bias - b0
        mean = load.mean()
        assert torch.allclose(delta[load > mean], torch.tensor(-0.01))
        assert torch.allclose(delta[load < mean], torch.tensor(0.01))
    assert all(load.sum() == 0 for load in bal.load)
    bal.remove()

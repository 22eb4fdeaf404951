import torch

from glm5.train.loop.losses import IGNORE, lm_and_mtp, shifted
from tests.glm5._util import make_model, random_ids


def test_shifted_inputs_and_targets():
    ids = torch.arange(6)[None]
    tok, tgt = shifted(ids, 2)
    assert tok.tolist() == [[2, 3, 4, 5, 0, 0]]
    assert tgt.tolist() == [[3, 4, 5, IGNORE, IGNORE, IGNORE]]


def test_mtp_loss_matches_the_models_mtp_forward_logits():
    model = make_model()
    ids = random_ids(2, 24, seed=3)
    with torch.no_grad():
        out = lm_and_mtp(model, ids, mtp_steps=1)
        tok, tgt = shifted(ids, 1)
        logits = model.mtp_forward(tok, out.hidden).logits  # the public MTP path, full logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        lm = model(ids).logits[:, :-1]
        want_lm = torch.nn.functional.cross_entropy(lm.reshape(-1, lm.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.mtp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.lm, want_lm, rtol=1e-5, atol=1e-5)


def test_mtp_steps_share_the_layer_and_all_go_through_linear_cross_entropy():
    model = make_model()
    ids = random_ids(1, 24, seed=4)
    before = model.backend.calls["linear_cross_entropy"]
    out = lm_and_mtp(model, ids, mtp_steps=3)
    assert model.backend.calls["linear_cross_entropy"] - before == 4  # main + 3 MTP steps
    out.mtp.backward()
    mtp_layer = model.model.layers[model.config.num_hidden_layers]
    assert mtp_layer.eh_proj.weight.grad.abs().sum() > 0
    assert model.lm_head.weight.grad.abs().sum() > 0  # shared output head

"""Generation: cached greedy decoding, MTP speculative decoding, the acceptance rule, the CLI."""

import json

import pytest
import torch
from click.testing import CliRunner

from glm5.cli import main
from glm5.generate import accept_drafts, generate, generate_speculative
from tests.glm5._util import make_model, random_ids


def test_greedy_generate_matches_recomputing_without_cache(tiny):
    ids = random_ids(2, 20, seed=4)
    res = generate(tiny, ids, 6, block_size=4)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, tiny(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert res.tokens == seq[:, 20:].tolist()
    assert res.main_passes == 6 and res.acceptance_length is None


@pytest.mark.parametrize("k, block", [(1, None), (3, 4)])
def test_mtp_speculative_greedy_equals_plain_greedy(tiny, k, block):
    ids = random_ids(1, 24, seed=5)
    plain = generate(tiny, ids, 10)
    spec = generate_speculative(tiny, ids, 10, num_draft=k, block_size=block)
    assert spec.tokens == plain.tokens
    assert sum(spec.rounds) + 1 >= 10 and all(1 <= r <= k + 1 for r in spec.rounds)
    assert 1.0 <= spec.acceptance_length <= k + 1


def test_accept_drafts_greedy():
    target = torch.full((4, 8), -1.0)
    target[0, 3] = target[1, 5] = target[2, 1] = target[3, 7] = 1.0  # argmax 3, 5, 1, then bonus 7
    assert accept_drafts(target, [3, 5, 1], [None] * 3, 0.0, None) == (3, 7)
    assert accept_drafts(target, [3, 6, 1], [None] * 3, 0.0, None) == (1, 5)
    assert accept_drafts(target, [0, 5, 1], [None] * 3, 0.0, None) == (0, 3)


def test_accept_drafts_sampling_keeps_the_target_distribution():
    """Speculative sampling must emit tokens distributed as the target model, whatever the draft."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    q = torch.softmax(torch.tensor([-1.0, 0.0, 2.0, 0.5]), 0)
    target = torch.stack([p_logits, torch.zeros(4)])
    n, counts = 4000, torch.zeros(4)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        acc, nxt = accept_drafts(target, [d], [q], 1.0, g)
        counts[d if acc == 1 else nxt] += 1
    p = torch.softmax(p_logits, 0)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() < 4 * sigma).all(), (counts / n, p)


def test_speculative_sampling_is_seeded(tiny):
    ids = random_ids(1, 12, seed=6)
    a = generate_speculative(tiny, ids, 8, num_draft=2, temperature=0.8, seed=3)
    b = generate_speculative(tiny, ids, 8, num_draft=2, temperature=0.8, seed=3)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 8


def test_generate_errors(tiny):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, random_ids(1, 4), 0)
    with pytest.raises(ValueError, match="input_ids"):
        generate_speculative(tiny, random_ids(2, 4), 4)
    with pytest.raises(ValueError, match="num_draft"):
        generate_speculative(tiny, random_ids(1, 4), 4, num_draft=0)


def test_cli_generate(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "c")
    runner = CliRunner()
    r = runner.invoke(
        main,
        [
            "generate",
            "--model",
            str(tmp_path / "c"),
            "--prompt-ids",
            "1,2,3,4,5",
            "--max-new-tokens",
            "5",
            "--mtp",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["tokens"] == generate(tiny, torch.tensor([[1, 2, 3, 4, 5]]), 5).tokens[0]
    assert out["acceptance_length"] >= 1.0
    r = runner.invoke(main, ["generate", "--preset", "tiny", "--model", str(tmp_path / "c")])
    assert r.exit_code != 0 and "exactly one" in r.output


def test_trained_mtp_drafts_are_accepted():
    """Fit the MTP layer (alone) to the main model's own greedy continuation, trained without a cache;
    speculative decoding with caches must then accept its drafts. An off-by-one between MTP slots,
    positions or cached hidden states would keep the acceptance length near 1."""
    model = make_model()
    prompt = random_ids(1, 16, seed=12)
    seq = torch.cat([prompt, torch.tensor(generate(model, prompt, 48).tokens)], 1)  # [1, 64]
    with torch.no_grad():
        hidden = model(seq).hidden_states
    model.requires_grad_(False)
    params = list(model.model.layers[model.config.num_hidden_layers].parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(80):
        out = model.mtp_forward(seq[:, 1:], hidden[:, :-1])  # slot i: token i+1, hidden i -> token i+2
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], seq[0, 2:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    for k, least in ((1, 1.8), (2, 2.5)):
        res = generate_speculative(model, prompt, 40, num_draft=k)
        assert res.tokens[0] == seq[0, 16:56].tolist()
        assert res.acceptance_length >= least, (k, res.rounds)

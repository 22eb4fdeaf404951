"""IcePop (glm5/train/rl/icepop.py): pop() masks mismatched tokens, the decoupled clip zeroes the gradient
past 1 - 0.2 / 1 + 0.28, and on a tiny categorical policy whose rollouts come from a perturbed copy (the
FP8 engine's stand-in) IcePop raises the reward while the popped tokens carry no gradient."""

from __future__ import annotations

import math

import torch

from glm5.train.rl.icepop import group_advantages, icepop_loss, pop


def test_pop_keeps_the_band_half_to_two():
    k = torch.tensor([0.49, 0.5, 1.0, 2.0, 2.01])
    assert pop(k).tolist() == [0.0, 0.5, 1.0, 2.0, 0.0]


def test_popped_and_clipped_tokens_carry_no_gradient():
    logp_old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    # token 0: mismatch 0.5/0.1 = 5 -> popped; token 1: r = 1.5 > 1.28 with A > 0 -> clipped;
    # token 2: r = 0.7 < 0.8 with A < 0 -> clipped; token 3: inside everything
    logp_roll = torch.log(torch.tensor([[0.1, 0.5, 0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.5, 0.75, 0.35, 0.55]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    loss, stats = icepop_loss(logp, logp_old, logp_roll, adv)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[1] == 0 and g[2] == 0 and g[3] != 0
    assert math.isclose(g[3].item(), -(0.55 / 0.5) / 4, rel_tol=1e-5)  # d(-r A / n)/d logp = -r A / n
    assert (
        stats.popped == 0.25 and stats.clipped == 0.5 and math.isclose(stats.mismatch_max, 5.0, rel_tol=1e-5)
    )


def test_group_advantages_standardise_per_prompt():
    a = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 5.0]), 2)
    assert torch.allclose(a[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5) and (a[4:] == 0).all()


def test_icepop_improves_a_tiny_policy_under_rollout_mismatch():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, steps, group = 8, 4, 16
    logits = torch.zeros(vocab, requires_grad=True)  # the tiny policy: one categorical per step
    opt = torch.optim.SGD([logits], lr=0.5)
    target = 3
    rewards_seen, popped = [], []
    for _ in range(30):
        with torch.no_grad():
            # the rollout engine runs a perturbed copy of the policy (as an FP8 engine would)
            roll_logits = logits + torch.randn(vocab, generator=g) * 0.8
            p_roll = torch.softmax(roll_logits, -1)
            y = torch.multinomial(p_roll.expand(group, vocab), steps, replacement=True, generator=g)
            logp_roll = torch.log(p_roll)[y]
            logp_old = torch.log_softmax(logits, -1)[y]
            reward = (y == target).float().mean(1)
        adv = group_advantages(reward, group)
        for _ in range(2):  # two PPO epochs on the batch
            loss, st = icepop_loss(torch.log_softmax(logits, -1)[y], logp_old, logp_roll, adv)
            opt.zero_grad()
            loss.backward()
            opt.step()
        rewards_seen.append(float(torch.softmax(logits.detach(), -1)[target]))
        popped.append(st.popped)
    assert rewards_seen[-1] > 0.5 > rewards_seen[0]
    assert max(popped) > 0  # the mismatch was large enough that pop() dropped tokens

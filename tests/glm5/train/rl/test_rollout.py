import torch

from glm5.train.rl.rollout import batch_invariant, rollout_check
from tests.glm5._util import make_model, random_ids


def test_ratio_is_exactly_one_with_batch_invariant_kernels():
    model = make_model()
    stats = rollout_check(model, random_ids(2, 20, vocab=256, seed=5), 6, seed=1, invariant=True)
    assert stats["tokens"] == 12
    assert stats["bitwise_equal"] and stats["ratio_min"] == 1.0 == stats["ratio_max"]
    assert stats["outside_half_to_two"] == 0.0


def test_ratio_statistics_without_invariance_are_rounding_sized():
    model = make_model()
    stats = rollout_check(model, random_ids(1, 20, vocab=256, seed=6), 6, seed=2, invariant=False)
    assert stats["max_abs_logprob_diff"] < 1e-4
    assert 0.999 < stats["ratio_min"] <= stats["ratio_max"] < 1.001


def test_batch_invariant_rows_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(7)
    a, w = torch.randn(37, 64, generator=g), torch.randn(64, 48, generator=g)
    with batch_invariant():
        full = torch.sigmoid(a @ w)
        part = torch.sigmoid(a[:5] @ w)
        sm = torch.softmax(a, -1)
    assert torch.equal(full[:5], part)
    torch.testing.assert_close(full, torch.sigmoid(a @ w))
    torch.testing.assert_close(sm, torch.softmax(a, -1))

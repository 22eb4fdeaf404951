"""The cuda kernels that tile several tokens' rows together (grouped_matmul, fp8_block_matmul,
fp8_grouped_matmul): batch invariance is claimed on a device only (backends/cuda/_tiles.py), and their
row logic (each row read, masked and written in its own place) is checked here under either mode on
inputs whose every product and sum is exact, so no summation order can change a bit."""

from __future__ import annotations

import pytest
import torch

from tests.backends.cuda.conftest import INTERPRETED

SHARED_TILE_OPS = ("grouped_matmul", "fp8_block_matmul", "fp8_grouped_matmul")


@pytest.mark.parametrize("op", SHARED_TILE_OPS)
def test_batch_invariance_is_claimed_on_a_device_only(cuda, op):
    caps = cuda.capabilities(op)
    assert caps.batch_invariant is not INTERPRETED
    assert "TRITON_INTERPRET" in caps.notes["batch_invariant"]


def _small_ints(shape, seed, lo=-4, hi=5):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).float()


def test_float_grouped_rows_alone_equal_rows_in_the_batch(cuda, device):
    # one expert takes 70 rows (several M-tiles, a partial last one); integers below 2^24 sum exactly
    x, w = _small_ints((70, 256), 0), _small_ints((2, 48, 256), 1)
    offs = torch.tensor([0, 70, 70])
    full = cuda.grouped_matmul(x.to(device), w.to(device), offs.to(device), out_dtype=torch.float32).cpu()
    for r in (0, 31, 32, 69):
        one = torch.tensor([0, 1, 1])
        alone = cuda.grouped_matmul(
            x[r : r + 1].to(device), w.to(device), one.to(device), out_dtype=torch.float32
        )
        assert torch.equal(alone.cpu()[0], full[r]), r


def test_fp8_block_rows_alone_equal_rows_in_the_batch(cuda, device):
    # e4m3 holds the small integers exactly; power-of-two scales keep every block product exact
    m, n, k = 70, 130, 256
    x_q = _small_ints((m, k), 2).to(torch.float8_e4m3fn)
    w_q = _small_ints((n, k), 3).to(torch.float8_e4m3fn)
    x_s = 2.0 ** _small_ints((m, k // 128), 4, -2, 3)
    w_s = 2.0 ** _small_ints((2, k // 128), 5, -2, 3)
    args = [t.to(device) for t in (w_q, w_s)]
    full = cuda.fp8_block_matmul(x_q.to(device), x_s.to(device), *args, None, torch.float32).cpu()
    for r in (0, 31, 32, 69):
        alone = cuda.fp8_block_matmul(
            x_q[r : r + 1].to(device), x_s[r : r + 1].to(device), *args, None, torch.float32
        )
        assert torch.equal(alone.cpu()[0], full[r]), r

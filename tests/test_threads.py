"""Thread policy (issue 21): the `glm5` commands' intra-op thread counts (glm5/threads.py) and the cpu
backend's block runner (backends/cpu/_parallel.py): one thread per block, the caller's count restored."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from click.testing import CliRunner

from backends import SeqLayout, intra_op
from backends.cpu import _parallel
from backends.cpu import sparse_mla_attention as cpu_attn
from glm5 import threads
from glm5.cli import main


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_user_env(monkeypatch):
    for name in threads.USER_ENV:
        monkeypatch.delenv(name, raising=False)


def test_conformance_and_train_get_one_thread_other_commands_keep_torchs(no_user_env):
    assert threads.command_threads("conformance") == 1
    assert threads.command_threads("train") == 1
    assert threads.command_threads("generate") is None
    assert threads.command_threads(None) is None


@pytest.mark.parametrize("name", threads.USER_ENV)
def test_an_explicit_environment_count_is_left_alone(no_user_env, monkeypatch, name):
    monkeypatch.setenv(name, "2")
    assert threads.command_threads("conformance") is None
    assert threads.command_threads("train") is None


def test_an_explicit_option_wins_and_zero_is_every_core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.command_threads("train", 3) == 3
    assert threads.command_threads("train", 0) == threads.cores()


def test_glm5_conformance_runs_one_thread(no_user_env, two_threads):
    res = CliRunner().invoke(main, ["conformance", "--help"])
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == 1


def test_glm5_conformance_keeps_the_users_omp_num_threads(no_user_env, two_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    res = CliRunner().invoke(main, ["conformance", "--help"])
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == 2


def test_glm5_doctor_keeps_torchs_default(no_user_env, two_threads):
    assert threads.apply_command_threads("doctor") is None
    assert torch.get_num_threads() == 2


def test_before_torch_loads_the_policy_goes_through_the_environment(no_user_env, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh `glm5` process: no torch import for --help
    assert threads.apply_command_threads("conformance") == 1
    assert "torch" not in sys.modules
    assert threads.user_set() and threads.command_threads("train") is None


def test_one_thread_restores_the_callers_count_also_after_an_error(two_threads):
    with pytest.raises(RuntimeError), intra_op.one_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_run_blocks_spreads_blocks_over_threads_on_one_intra_op_thread_in_the_callers_mode(two_threads, mode):
    seen, lock, both = [], threading.Lock(), threading.Barrier(2, timeout=30)

    def fn(b):
        if b < 2:  # each of the first two blocks waits for the other: two threads hold one each
            both.wait()
        torch.ones(1 << 16).exp_()  # a real kernel call in every thread
        with lock:
            modes = torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()
            seen.append((b, threading.current_thread().name, modes))

    with mode():
        want = 1, torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        _parallel.run_blocks(fn, iter(range(40)))
    assert sorted(b for b, _, _ in seen) == list(range(40))
    assert len({name for _, name, _ in seen}) == 2
    assert {m for _, _, m in seen} == {want}
    assert torch.get_num_threads() == 2


def test_run_blocks_raises_a_blocks_error_and_restores_the_count(two_threads):
    def fn(b):
        if b == 5:
            raise ValueError("block 5")

    with pytest.raises(ValueError, match="block 5"):
        _parallel.run_blocks(fn, range(20))
    assert torch.get_num_threads() == 2


def _attention_inputs(t=13, s=300, h=4, n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 72, generator=g)
    kv = torch.randn(s, 72, generator=g)
    idx = torch.stack([torch.randperm(s, generator=g)[:n] for _ in range(t)]).int()
    idx[::3, -5:] = -1
    return q, kv, idx, SeqLayout.from_lengths([t], [s])


def test_cpu_attention_blocks_run_one_thread_and_match_the_one_thread_bits(two_threads, monkeypatch):
    q, kv, idx, layout = _attention_inputs()
    monkeypatch.setattr(cpu_attn, "GATHER_ELEMS", 3 * 70 * 72)  # 3 queries a block: 5 blocks
    with intra_op.one_thread():
        want = cpu_attn.sparse_mla_attention(q, kv, idx, layout, 0.1, 64)
    seen = []
    block = cpu_attn._Workspace.block

    def spy(self, *args):
        seen.append(torch.get_num_threads())
        return block(self, *args)

    monkeypatch.setattr(cpu_attn._Workspace, "block", spy)
    got = cpu_attn.sparse_mla_attention(q, kv, idx, layout, 0.1, 64)
    assert len(seen) == 5 and set(seen) == {1}  # before: every block on the caller's 2 threads
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.get_num_threads() == 2


def _cpu_attention_grads(q, kv, idx, layout):
    import backends

    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = backends.get("cpu").sparse_mla_attention(q, kv, idx, layout, 0.1, 64)
    (out.square().sum() + lse.nan_to_num(0, 0, 0).sum()).backward()
    return out.detach(), q.grad, kv.grad


def test_cpu_attention_through_autograd_on_two_threads_matches_one_thread(two_threads, monkeypatch):
    # the custom op's forward runs without autograd: its blocks on other threads must too (grad mode is
    # thread-local; recorded there, `index_select(out=)` raised on inputs that require grad)
    args = _attention_inputs()
    monkeypatch.setattr(cpu_attn, "GATHER_ELEMS", 3 * 70 * 72)
    got = _cpu_attention_grads(*args)
    with intra_op.one_thread():
        want = _cpu_attention_grads(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cpu_attention_in_inference_mode_on_two_threads(two_threads, monkeypatch):
    q, kv, idx, layout = _attention_inputs()
    monkeypatch.setattr(cpu_attn, "GATHER_ELEMS", 3 * 70 * 72)
    with torch.inference_mode():
        got = cpu_attn.sparse_mla_attention(q, kv, idx, layout, 0.1, 64)
    with intra_op.one_thread():
        want = cpu_attn.sparse_mla_attention(q, kv, idx, layout, 0.1, 64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

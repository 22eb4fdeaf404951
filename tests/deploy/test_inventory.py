"""The planner's weight and cache arithmetic against real tensors: the tiny GLM-5 instantiated and saved, its
quantized exports (quant/ export functions, both formats), its shards, and its KV caches."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.deploy import memory
from glm5.deploy.inventory import ShardError, inventory, meta_model, totals
from quant.apply import plan_model
from quant.load import export
from quant.quantize import quantize_model
from quant.recipe import Recipe


def tiny(dtype: torch.dtype = torch.bfloat16) -> GLM5ForCausalLM:
    m = GLM5ForCausalLM(GLM5Config.from_preset("tiny"), backend="reference", dtype=dtype)
    m.init_weights(0)
    return m.eval()


def stored(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def recipe_of(name: str) -> Recipe:
    if name != "glm5-w4a8-g128":
        return Recipe.load(name)
    # the tiny model's experts are 64 x 32: groups of 16 instead of 128; round-to-nearest instead of GPTQ
    # (which needs calibration data): the stored layout is the same
    r = Recipe.load(name, group_size=16)
    r.calibration = {**r.calibration, "int4": {"weight_method": "minmax"}}
    return r


def planned(config: GLM5Config, recipe: str | None, fmt: str, dtype: torch.dtype = torch.bfloat16):
    """The planner's inventory: built on the meta device from the config alone, as `glm5 plan` does."""
    model = meta_model(config, dtype)
    return inventory(model, plan_model(model, recipe_of(recipe)) if recipe else {}, fmt)


def by_name(weights) -> dict[str, int]:
    return {n: p.nbytes for w in weights for n, p in w.stored_names()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_inventory_is_the_saved_checkpoint(tmp_path, dtype):
    model = tiny(dtype)
    model.save_pretrained(tmp_path / "f")
    real = {k: t.numel() * t.element_size() for k, t in stored(tmp_path / "f").items()}
    got = by_name(planned(model.config, None, "hf", dtype))
    assert got == real
    assert sum(got.values()) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """recipe -> format -> (stored tensors of the export, the in-memory quantized model)."""
    root = tmp_path_factory.mktemp("exports")
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for recipe, fmts in [
        ("glm5-w4a8", ("modelslim", "compressed-tensors")),
        ("glm5-w8a8", ("modelslim", "compressed-tensors")),
        ("glm5-w4a8-g128", ("compressed-tensors",)),
    ]:
        m = tiny()
        with torch.no_grad():
            quantize_model(m, recipe_of(recipe))
        for fmt in fmts:
            export(m, root / f"{recipe}-{fmt}", fmt)
            out.setdefault(recipe, {})[fmt] = stored(root / f"{recipe}-{fmt}")
    return out


@pytest.mark.parametrize(
    "recipe,fmt",
    [
        ("glm5-w4a8", "modelslim"),
        ("glm5-w4a8", "compressed-tensors"),
        ("glm5-w8a8", "modelslim"),
        ("glm5-w8a8", "compressed-tensors"),
        ("glm5-w4a8-g128", "compressed-tensors"),
    ],
)
def test_quantized_inventory_is_the_export(exports, recipe, fmt):
    real = {k: t.numel() * t.element_size() for k, t in exports[recipe][fmt].items()}
    weights = planned(GLM5Config.from_preset("tiny"), recipe, fmt)
    assert by_name(weights) == real  # every tensor, name by name, byte for byte
    schemes = totals(weights, "scheme")
    assert ("W4A8_DYNAMIC" in schemes or "W4A8_DYNAMIC(g16)" in schemes) == ("w4a8" in recipe)
    assert schemes["W8A8_DYNAMIC"] > 0 and schemes["FLOAT"] > 0


def test_modelslim_refuses_per_group_int4():
    with pytest.raises(ValueError, match="per channel"):
        planned(GLM5Config.from_preset("tiny"), "glm5-w4a8-g128", "modelslim")


# vLLM's split of each stored tensor, written out independently of the inventory's axis tags:
# (split, suffix) -> dim sharded (None: whole on every rank)
_VLLM_DIM = {
    ("col", ""): 0,
    ("col", "weight"): 0,
    ("col", "weight_scale"): 0,
    ("col", "weight_offset"): 0,
    ("col", "scale_bias"): 0,
    ("col", "weight_packed"): 0,
    ("col", "bias"): 0,
    ("col", "weight_shape"): None,
    ("row", ""): 1,
    ("row", "weight"): 1,
    ("row", "weight_packed"): 1,
    ("row", "scale_bias"): 1,
    ("row", "weight_offset"): None,
    ("row", "weight_shape"): None,
}


def _vllm_shard(t: torch.Tensor, split: str, suffix: str, parts: int) -> int:
    if split == "rep":
        return t.numel() * t.element_size()
    if suffix == "" and t.dim() == 1:  # a float 1-d parameter: split with its rows if col
        dim = 0 if split == "col" else None
    elif suffix == "weight_scale" and split == "row":  # per-channel: whole; per-group [N, K/g]: along K
        dim = 1 if t.shape[1] > 1 else None
    else:
        dim = _VLLM_DIM[(split, suffix)]
    if dim is None:
        return t.numel() * t.element_size()
    chunk = torch.tensor_split(t, parts, dim=dim)[0]
    return chunk.numel() * chunk.element_size()


_FORMATS = [
    ("glm5-w4a8", "modelslim"),
    ("glm5-w8a8", "compressed-tensors"),
    ("glm5-w4a8-g128", "compressed-tensors"),
]
_LAYOUTS = [(2, 1, True), (4, 1, False), (2, 2, True), (1, 4, False), (2, 1, False)]
# g16 experts without expert parallelism over 4 ranks: down_proj's K = 32 holds 2 groups, which 4 ranks
# cannot share (test_group_split_is_refused)
_CASES = [
    (r, f, *lay)
    for r, f in _FORMATS
    for lay in _LAYOUTS
    if not (r == "glm5-w4a8-g128" and lay[0] * lay[1] == 4 and not lay[2])
]


@pytest.mark.parametrize("recipe,fmt,tp,dp,ep", _CASES)
def test_rank_bytes_are_real_shards(exports, recipe, fmt, tp, dp, ep):
    """Rank 0's bytes from the planner equal the bytes of rank 0's slices of the exported tensors."""
    tensors = exports[recipe][fmt]
    weights = planned(GLM5Config.from_preset("tiny"), recipe, fmt)
    moe = tp * dp
    want = 0
    for w in weights:
        for name, part in w.stored_names():
            t = tensors[name]
            if w.split.startswith("expert"):
                e = int(name.split(".experts.")[1].split(".")[0])
                if ep:
                    want += t.numel() * t.element_size() if e < w.count // moe else 0
                else:
                    want += _vllm_shard(t, w.split.removeprefix("expert_"), part.suffix, moe)
            else:
                want += _vllm_shard(t, w.split, part.suffix, tp)
    assert sum(w.rank_bytes(tp, moe, ep) for w in weights) == want


def test_group_split_is_refused():
    weights = planned(GLM5Config.from_preset("tiny"), "glm5-w4a8-g128", "compressed-tensors")
    down = next(w for w in weights if w.split == "expert_row")
    assert down.rank_bytes(2, 2, False) > 0
    with pytest.raises(ShardError, match=r"weight_scale \[64, 2\]: dim 2 does not split over 4"):
        down.rank_bytes(4, 4, False)


def test_uneven_split_is_refused():
    weights = planned(GLM5Config.from_preset("tiny"), "glm5-w8a8", "modelslim")
    o_proj = next(w for w in weights if w.module.endswith("layers.0.self_attn.o_proj"))
    with pytest.raises(ShardError, match="does not split over 3"):
        o_proj.rank_bytes(3, 3, True)
    experts = next(w for w in weights if w.split == "expert_col")
    with pytest.raises(ShardError, match="8 experts do not split over 3"):
        experts.rank_bytes(1, 3, True)


@pytest.mark.parametrize("block_size", [None, 16])
def test_cache_bytes_per_token_match_the_model_cache(block_size):
    model = tiny()
    c = model.config
    b, n = 3, 40
    caches = [
        model.new_cache(b, n, block_size=block_size),
        model.new_cache(b, n, mtp=True, block_size=block_size),
    ]
    real_kv = sum(t.numel() * t.element_size() for k in caches for t in k.kv)
    real_idx = sum(t.numel() * t.element_size() for k in caches for t in k.index_k if t is not None)
    per_tok = memory.cache_bytes_per_token(c, "bf16", "bf16", mtp=True)
    slots = b * memory.tokens_per_sequence(n, 0, block_size or 1)
    assert (per_tok.kv * slots, per_tok.indexer * slots) == (real_kv, real_idx)
    # tiny: 4 main layers (pattern FFSF: 3 with an indexer) + 1 MTP layer that always has one
    assert (per_tok.layers, per_tok.indexer_layers) == (5, 4)
    assert memory.cache_bytes_per_token(c, "bf16", "bf16", mtp=False).layers == 4


def test_glm5_cache_formats_are_the_published_sizes():
    c = GLM5Config.from_preset("glm5-744b")
    assert (memory.latent_bytes(c, "bf16"), memory.indexer_bytes(c, "bf16")) == (576 * 2, 128 * 2)
    assert (memory.latent_bytes(c, "fp8"), memory.indexer_bytes(c, "fp8")) == (656, 132)
    assert memory.cache_bytes_per_token(c, "fp8", "fp8", mtp=False).total == 78 * 788
    assert memory.cache_bytes_per_token(c, "bf16", "fp8", mtp=True).total == 79 * (1152 + 132)
    with pytest.raises(ValueError, match="kv_cache"):
        memory.latent_bytes(c, "int4")
    assert memory.tokens_per_sequence(200000, 3, 128) == 1563 * 128


# vLLM's DeepseekV2 / GlmMoeDsa layers (dsa_semantics.md 5): ReplicatedLinear for the low-rank
# projections and the whole indexer, Column/RowParallelLinear for the per-head projections and MLPs
_VLLM_SPLIT = {
    "self_attn.q_a_proj": "rep", "self_attn.kv_a_proj_with_mqa": "rep", "self_attn.q_b_proj": "col",
    "self_attn.kv_b_proj": "col", "self_attn.o_proj": "row", "indexer.wq_b": "rep", "indexer.wk": "rep",
    "indexer.weights_proj": "rep", "indexer.k_norm": "rep", "mlp.gate": "rep", "mlp.gate_proj": "col",
    "mlp.up_proj": "col", "mlp.down_proj": "row", "shared_experts.gate_proj": "col",
    "shared_experts.up_proj": "col", "shared_experts.down_proj": "row", "experts.0.gate_proj": "expert_col",
    "experts.0.up_proj": "expert_col", "experts.0.down_proj": "expert_row", "model.embed_tokens": "col",
    "lm_head": "col", "eh_proj": "rep",
}  # fmt: skip


def test_sharding_follows_vllm():
    weights = planned(GLM5Config.from_preset("tiny"), "glm5-w4a8", "modelslim")
    seen = set()
    for w in weights:
        key = next((k for k in _VLLM_SPLIT if w.module.endswith(k)), None)
        if key is None:
            assert w.module.rsplit(".", 1)[1].endswith("norm") and w.split == "rep", w.module
            continue
        seen.add(key)
        assert w.split == _VLLM_SPLIT[key], w.module
    assert seen == set(_VLLM_SPLIT)

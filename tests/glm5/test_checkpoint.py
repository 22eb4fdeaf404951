"""Hugging Face checkpoint layout: published names, bitwise round trip, sharding, errors by name."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm5.core.checkpoint import CheckpointError
from glm5.core.model import GLM5ForCausalLM
from tests.glm5._util import random_ids


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_published_names(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "c")
    names = set(_tensors(tmp_path / "c"))
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["num_hidden_layers"] == 4
    for n in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.self_attn.indexer.wq_b.weight",
        "model.layers.1.self_attn.indexer.wk.weight",
        "model.layers.1.self_attn.indexer.k_norm.weight",
        "model.layers.1.self_attn.indexer.k_norm.bias",
        "model.layers.1.self_attn.indexer.weights_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.4.enorm.weight",
        "model.layers.4.hnorm.weight",
        "model.layers.4.shared_head.norm.weight",
        "model.layers.4.self_attn.indexer.wk.weight",
    ):
        assert n in names, n
    assert not any(n.startswith("model.layers.2.self_attn.indexer") for n in names)  # shared layer
    assert "model.layers.1.mlp.experts.gate_proj" not in names


@pytest.mark.parametrize("shard", [None, 40_000])
def test_round_trip_is_bitwise(tiny, tmp_path, shard):
    kw = {} if shard is None else {"max_shard_size": shard}
    tiny.save_pretrained(tmp_path / "a", **kw)
    if shard:
        index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path / "a", backend="reference")
    a, b = tiny.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    loaded.save_pretrained(tmp_path / "b", **kw)
    ta, tb = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    ids = random_ids(1, 20)
    with torch.no_grad():
        assert torch.equal(tiny(ids).logits, loaded(ids).logits)


def test_save_replaces_existing_checkpoint(tiny, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "stale.safetensors").write_bytes(b"junk")
    tiny.save_pretrained(tmp_path / "c")
    assert not (tmp_path / "c" / "stale.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary directories left


def _edit(tmp_path, tiny, fn):
    tiny.save_pretrained(tmp_path / "c")
    f = tmp_path / "c" / "model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, f)
    return tmp_path / "c"


def test_missing_unexpected_misshaped_are_named(tiny, tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        del t["model.layers.3.self_attn.indexer.k_norm.bias"]
        t["model.layers.9.self_attn.o_proj.weight"] = torch.zeros(2)
        t["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)

    path = _edit(tmp_path, tiny, edit)
    with pytest.raises(CheckpointError) as e:
        GLM5ForCausalLM.from_pretrained(path, backend="reference")
    err = e.value
    assert isinstance(err, ValueError)
    assert err.missing == [
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.3.self_attn.indexer.k_norm.bias",
    ]
    assert err.unexpected == ["model.layers.9.self_attn.o_proj.weight"]
    assert len(err.mismatched) == 1 and err.mismatched[0].startswith(
        "model.layers.0.self_attn.kv_b_proj.weight"
    )
    assert "[128, 32]" in err.mismatched[0] and "[3, 3]" in err.mismatched[0]
    for name in err.missing + err.unexpected:
        assert name in str(err)


def test_unexpected_tolerated_when_not_strict(tiny, tmp_path):
    path = _edit(tmp_path, tiny, lambda t: t.update({"extra.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="extra.weight"):
        GLM5ForCausalLM.from_pretrained(path, backend="reference")
    GLM5ForCausalLM.from_pretrained(path, backend="reference", strict=False)


def test_mtp_copies_of_shared_tensors(tiny, tmp_path):
    """DeepSeek-style checkpoints repeat embed_tokens / the head inside the MTP layer: accepted when equal."""

    def same(t):
        t["model.layers.4.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.4.shared_head.head.weight"] = t["lm_head.weight"].clone()

    GLM5ForCausalLM.from_pretrained(_edit(tmp_path / "a", tiny, same), backend="reference")

    def differ(t):
        t["model.layers.4.shared_head.head.weight"] = t["lm_head.weight"] + 1

    with pytest.raises(CheckpointError, match="shared_head.head.weight"):
        GLM5ForCausalLM.from_pretrained(_edit(tmp_path / "b", tiny, differ), backend="reference")


def test_weights_proj_and_router_stay_fp32_in_bf16_checkpoint(tmp_path):
    from tests.glm5._util import make_model

    m = make_model()
    m = type(m)(m.config, backend="reference", dtype=torch.bfloat16)
    m.init_weights(1)
    m.save_pretrained(tmp_path / "c")
    with safe_open(tmp_path / "c" / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.layers.1.self_attn.q_a_proj.weight").dtype == torch.bfloat16
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path / "c", backend="reference")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32

"""Config fields, indexer_types derivation, presets, and the 744B preset on the meta device."""

import pytest
import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM


def test_indexer_types_derivation():
    base = dict(num_hidden_layers=6)
    assert GLM5Config(**base).indexer_types == ["full"] * 6  # plain GLM-5: every layer full
    assert GLM5Config(**base, index_topk_freq=2, index_skip_topk_offset=2).indexer_types == [
        "full",
        "full",
        "shared",
        "full",
        "shared",
        "full",
    ]
    assert GLM5Config(num_hidden_layers=4, index_topk_pattern="FSSF").indexer_types == [
        "full",
        "shared",
        "shared",
        "full",
    ]
    explicit = ["full", "shared", "full", "full", "shared", "full"]
    assert GLM5Config(**base, indexer_types=explicit).indexer_types == explicit


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(num_hidden_layers=2, index_topk_pattern="SF"), "indexer_types"),
        (dict(num_hidden_layers=2, index_topk_pattern="FX"), "index_topk_pattern"),
        (dict(num_hidden_layers=2, indexer_types=["full"]), "indexer_types"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(n_routed_experts=10, n_group=3), "n_group"),
        (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    ],
)
def test_invalid_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        GLM5Config(**bad)


def test_from_dict_reads_hf_config_and_rejects_other_models():
    hf = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "index_topk": 64,
    }
    c = GLM5Config.from_dict(hf)
    assert c.rope_theta == 10000.0 and c.index_topk == 64 and c.sm_scale == 256**-0.5
    assert GLM5Config.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="model_type"):
        GLM5Config.from_dict({"model_type": "deepseek_v32"})
    with pytest.raises(ValueError, match="preset"):
        GLM5Config.from_preset("nope")


def _expected_counts(c: GLM5Config) -> tuple[int, int, int]:
    d, h = c.hidden_size, c.num_attention_heads
    attn = (
        d * c.q_lora_rank
        + c.q_lora_rank
        + c.q_lora_rank * h * c.qk_head_dim
        + d * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank
        + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
        + h * c.v_head_dim * d
    )
    indexer = (
        c.q_lora_rank * c.index_n_heads * c.index_head_dim
        + d * c.index_head_dim
        + 2 * c.index_head_dim
        + d * c.index_n_heads
    )
    routed = c.n_routed_experts * 3 * d * c.moe_intermediate_size
    moe = (
        c.n_routed_experts * d
        + c.n_routed_experts
        + routed
        + 3 * d * c.moe_intermediate_size * c.n_shared_experts
    )
    dense = 3 * d * c.intermediate_size
    k, n = c.first_k_dense_replace, c.num_hidden_layers
    main = (
        2 * c.vocab_size * d
        + d
        + k * (attn + indexer + dense + 2 * d)
        + (n - k) * (attn + indexer + moe + 2 * d)
    )
    mtp = attn + indexer + moe + 2 * d + 2 * d + 2 * d * d + d
    active = main - (n - k) * routed * (1 - c.num_experts_per_tok / c.n_routed_experts)
    return main, mtp, int(active)


def test_glm5_744b_on_meta_device():
    cfg = GLM5Config.from_preset("glm5-744b")
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, backend="reference", dtype=torch.bfloat16)
    assert model.lm_head.weight.is_meta
    counts = model.parameter_counts()
    main, mtp, active = _expected_counts(cfg)
    assert counts["total_without_mtp"] == main and counts["mtp"] == mtp
    assert counts["activated_without_mtp"] == active
    assert 743e9 < main < 745e9 and 40e9 < active < 43e9  # "744B total, 40B active"
    mtp_layer = model.model.layers[78]
    assert mtp_layer.eh_proj.weight.shape == (6144, 12288)
    assert mtp_layer.self_attn.indexer is not None
    assert model.model.layers[5].mlp.experts.gate_proj.shape == (256, 2048, 6144)
    assert model.model.layers[5].self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_lora_norm_eps_reproduces_transformers_q_a_and_kv_a_norms():
    """transformers hard-codes eps 1e-6 in q_a_layernorm / kv_a_layernorm; lora_norm_eps=1e-6 gives the
    model exactly that, and None (the default) keeps rms_norm_eps as vLLM / SGLang do."""
    from tests.glm5._util import make_model, random_ids

    base = make_model(rms_norm_eps=1e-5)
    hf = make_model(rms_norm_eps=1e-5, lora_norm_eps=1e-6)
    for m, eps in ((base, 1e-5), (hf, 1e-6)):
        for layer in m.model.layers:
            assert layer.self_attn.q_a_layernorm.eps == eps and layer.self_attn.kv_a_layernorm.eps == eps
    x = torch.randn(3, hf.config.q_lora_rank, dtype=torch.float64) * 1e-3
    norm = hf.model.layers[0].self_attn.q_a_layernorm
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-6, atol=0)
    ids = random_ids(1, 20)
    with torch.no_grad():
        assert not torch.equal(base(ids).logits, hf(ids).logits)
    again = GLM5Config.from_dict(hf.config.to_dict())
    assert again.lora_norm_eps == 1e-6 and GLM5Config.from_preset("tiny").lora_norm_eps is None
    with pytest.raises(ValueError, match="lora_norm_eps"):
        GLM5Config.from_preset("tiny", lora_norm_eps=-1.0)

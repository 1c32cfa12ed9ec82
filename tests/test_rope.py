"""RoPE: rotation keeps norms, scores depend only on relative position, Llama-3 scaling as HF computes it."""

import pytest
import torch

from minillama.rope import apply_rope, inv_frequencies, rope_cos_sin
from tiny import tiny_config


def _rotate(x, pos, config):
    cos, sin = rope_cos_sin(torch.tensor([pos]), inv_frequencies(config), torch.float64)
    return apply_rope(x[None, None], cos, sin)[0, 0]


@pytest.mark.parametrize("llama3", [False, True])
def test_rotation_keeps_norm_and_depends_on_relative_position(llama3):
    config = tiny_config(head_dim=16, llama3=llama3)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, dtype=torch.float64, generator=g), torch.randn(16, dtype=torch.float64, generator=g)
    for pos in (0, 1, 17, 900):
        assert torch.allclose(_rotate(q, pos, config).norm(), q.norm(), atol=1e-12)
    for m, n in [(5, 2), (105, 102), (1003, 1000)]:  # all at distance 3
        score = _rotate(q, m, config) @ _rotate(k, n, config)
        assert score == pytest.approx(float(_rotate(q, 3, config) @ _rotate(k, 0, config)), abs=1e-9)
    far = _rotate(q, 10, config) @ _rotate(k, 0, config)
    assert abs(float(far) - float(_rotate(q, 3, config) @ _rotate(k, 0, config))) > 1e-3


def test_position_zero_is_identity():
    config = tiny_config(head_dim=8)
    x = torch.randn(8, dtype=torch.float64)
    assert torch.equal(_rotate(x, 0, config), x)


def test_llama3_scaling_matches_hf():
    utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    config = tiny_config(head_dim=64, heads=2, kv_heads=2, theta=500000.0, llama3=True)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "architectures"})
    inv_freq, _ = utils.ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    torch.testing.assert_close(inv_frequencies(config), inv_freq.float(), atol=0, rtol=1e-6)
    plain = inv_frequencies(tiny_config(head_dim=64, heads=2, kv_heads=2, theta=500000.0))
    assert torch.equal(inv_frequencies(config)[:3], plain[:3])  # wavelengths under 64/4 untouched
    assert torch.allclose(inv_frequencies(config)[-1], plain[-1] / 8)  # low ones slowed by the factor


def test_config_reads_transformers5_rope_parameters():
    from minillama.config import LlamaConfig

    c = LlamaConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    c = LlamaConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling


def test_folded_sign_gives_the_same_bits():
    from minillama.rope import apply_rope_folded, signed_sin
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 16, generator=g)
    cos, sin = rope_cos_sin(torch.arange(50), torch.rand(8, generator=g), torch.float32)
    assert torch.equal(apply_rope_folded(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))

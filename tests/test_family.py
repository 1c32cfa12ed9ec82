"""The Llama family against HF transformers: Llama with biases, Mistral with a sliding window, Qwen2, Qwen3,
RoPE linear / dynamic / yarn, `hidden_act: swish`; through HF directories and GGUF files.

Each checkpoint is HF's own: a model built by `AutoModelForCausalLM.from_config` on a tiny config, its
weights redrawn so that logits spread out, written with `save_pretrained`; minillama loads the directory
(and a GGUF written from it as llama.cpp's converter lays it out) and must give HF's logits within 1e-5
(float32) and the same argmax at every position of a sequence longer than the window and the original
context. The parity property (parallel == independent) runs these switches in tests/test_parity.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from _ckpt_writers import write_gguf  # noqa: E402
from minillama import family  # noqa: E402
from minillama.config import LlamaConfig  # noqa: E402
from minillama.weights import (WeightsError, build_model, expected_shapes, hf_config,  # noqa: E402
                               llama3_rope_factors, llama3_scaling_from_factors, load_state_dict)

SEQ = 150  # past every window below and past yarn's original context (64)
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# (HF config class, fields): several tiny configs per family member and per switch.
CASES = {
    "llama-attention-bias": ("LlamaConfig", dict(attention_bias=True)),
    "llama-mlp-bias": ("LlamaConfig", dict(mlp_bias=True, num_key_value_heads=4)),
    "llama-both-biases-tied": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                   num_key_value_heads=1)),
    "llama-swish": ("LlamaConfig", dict(hidden_act="swish")),
    "llama-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-yarn": ("LlamaConfig", dict(rope_scaling=YARN)),
    "llama-yarn-betas": ("LlamaConfig", dict(rope_scaling={**YARN, "factor": 8.0, "beta_fast": 16, "beta_slow": 2},
                                             rope_theta=500000.0, head_dim=32)),
    "mistral-window-40": ("MistralConfig", dict(sliding_window=40)),
    "mistral-window-64-head-dim": ("MistralConfig", dict(sliding_window=64, head_dim=32)),
    "mistral-window-100-mha": ("MistralConfig", dict(sliding_window=100, num_key_value_heads=4)),
    "mistral-no-window": ("MistralConfig", dict(sliding_window=None)),
    # layer_types: HF runs it as Ministral, layer by layer (minillama slid every layer)
    "mistral-layer-types-full": ("MistralConfig", dict(sliding_window=40, layer_types=["full_attention"] * 2)),
    "mistral-layer-types-sliding": ("MistralConfig", dict(sliding_window=40, layer_types=["sliding_attention"] * 2)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen2-tied-gqa": ("Qwen2Config", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2-window-all-layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=33, max_window_layers=0)),
    "qwen2-yarn": ("Qwen2Config", dict(rope_scaling=YARN)),
    # as Qwen2.5's model card adds YaRN: over max_position_embeddings itself, so SEQ runs past it (HF has no bound)
    "qwen2-yarn-past-its-context": ("Qwen2Config", dict(rope_scaling=YARN, max_position_embeddings=64)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3-head-dim-8-bias": ("Qwen3Config", dict(head_dim=8, attention_bias=True)),
    "qwen3-tied-mha": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True, num_key_value_heads=4)),
}


def hf_checkpoint(name: str, out: Path, seed: int = 0):
    """HF's model for CASES[name], weights redrawn (norms ~1, biases ~0.1, projections ~1/sqrt(fan in)),
    saved with save_pretrained into `out`. Returns the model HF loads from there (eager attention, float32, eval)."""
    cls, fields = CASES[name]
    kw = {**BASE, **fields}
    if "rope_scaling" in kw:  # transformers 5 spells it rope_parameters
        kw["rope_parameters"] = {"rope_theta": kw.pop("rope_theta", 10000.0), **kw.pop("rope_scaling")}
    config = getattr(transformers, cls)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in pname:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    model.save_pretrained(out)
    # as people run it: the class HF reads the saved config as (Mistral with layer_types is Ministral's)
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def compare(hf_model, path: Path) -> tuple[float, bool]:
    """(max |dlogit|, argmax equal everywhere) of minillama loading `path` against HF on one sequence."""
    config, sd = load_state_dict(path)
    ours = build_model(config, sd)
    ids = torch.randint(3, 101, (SEQ,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
    got = ours(ids)
    return (got - want).abs().max().item(), bool(torch.equal(got.argmax(-1), want.argmax(-1)))


def gguf_from_hf_dir(d: Path, out: Path) -> Path:
    """The GGUF llama.cpp's converter writes for this HF directory (F32; Q/K interleaved for `llama`)."""
    config, sd = load_state_dict(d)
    if config.model_type == "mistral":  # written as `llama`, which holds no window
        config.model_type, config.sliding_window = "llama", None
    return write_gguf(out, config, sd, None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_directory_matches_transformers(tmp_path, name):
    model = hf_checkpoint(name, tmp_path / "hf")
    diff, same_argmax = compare(model, tmp_path / "hf")
    assert diff <= 1e-5 and same_argmax, (name, diff, same_argmax)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral-no-window"])
def test_a_config_without_model_type_is_read_as_its_architectures_class(tmp_path, name):
    """config.json without `model_type` is read as the class its `architectures` names, as that class's
    `from_pretrained` reads it; it was read as Llama (a Qwen2 then refused for its biases, a Qwen3 for its q/k
    norms). A Mistral, whose saved fields Llama reads alike, loads either way."""
    model = hf_checkpoint(name, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [CASES[name][0].replace("Config", "ForCausalLM")]
    del cfg["model_type"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    diff, same_argmax = compare(model, tmp_path / "hf")
    assert diff <= 1e-5 and same_argmax, (name, diff, same_argmax)


# GGUF where llama.cpp's converter writes one: Llama (biases, linear/yarn RoPE), Qwen2 and Qwen3, and Mistral
# without a window (the `llama` architecture has none; with one, the converter's file is a different model).
GGUF_CASES = ["llama-attention-bias", "llama-both-biases-tied", "llama-mlp-bias", "llama-linear", "llama-yarn",
              "mistral-no-window", "qwen2", "qwen2-tied-gqa", "qwen2-yarn", "qwen2-yarn-past-its-context", "qwen3",
              "qwen3-head-dim-8-bias"]


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_matches_transformers(tmp_path, name):
    model = hf_checkpoint(name, tmp_path / "hf")
    path = gguf_from_hf_dir(tmp_path / "hf", tmp_path / "m.gguf")
    diff, same_argmax = compare(model, path)
    assert diff <= 1e-5 and same_argmax, (name, diff, same_argmax)


@pytest.mark.parametrize("name, drop", [
    ("llama-attention-bias", dict(attention_bias=False)), ("llama-mlp-bias", dict(mlp_bias=False)),
    ("qwen2", dict(model_type="llama")), ("qwen3", dict(model_type="llama")),
    ("mistral-window-40", dict(sliding_window=None)), ("qwen2-window-all-layers", dict(sliding_window=None)),
    ("llama-yarn", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    ("llama-linear", dict(rope_scaling=None)),
])
def test_a_switch_turned_off_is_caught(tmp_path, name, drop):
    """Negative control: the comparison notices each switch when minillama's model drops it (its tensors
    left out)."""
    model = hf_checkpoint(name, tmp_path)
    config, sd = load_state_dict(tmp_path)
    for k, v in drop.items():
        setattr(config, k, v)
    config.__post_init__()
    want = expected_shapes(config)
    ours = build_model(config, {k: v for k, v in sd.items() if k in want or k == "lm_head.weight"})
    ids = torch.randint(3, 101, (SEQ,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - model(ids[None]).logits[0]).abs().max().item()
    assert diff > 1e-3, (name, diff)


def test_defaults_of_each_model_type_are_hf_defaults():
    """A config.json that leaves a field out gets what HF's class for its model type gives."""
    for model_type, cls in [("mistral", "MistralConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")]:
        hf = getattr(transformers, cls)()
        for key, value in family.HF_DEFAULTS[model_type].items():
            assert getattr(hf, key) == value, (model_type, key)
        ours = LlamaConfig.from_dict(family.hf_fields({"model_type": model_type}))
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                    "bos_token_id", "eos_token_id", "sliding_window"):
            assert getattr(ours, key) == getattr(hf, key), (model_type, key)
        assert ours.rope_theta == hf.rope_parameters["rope_theta"], model_type
        assert ours.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads), model_type


def test_fields_a_model_type_does_not_read_are_ignored_as_hf_ignores_them():
    d = family.hf_fields({"model_type": "mistral", "attention_bias": True, "mlp_bias": True})
    assert not d["attention_bias"] and not d["mlp_bias"]
    assert not family.hf_fields({"model_type": "qwen3", "mlp_bias": True})["mlp_bias"]
    assert family.hf_fields({"model_type": "llama", "sliding_window": 8})["sliding_window"] is None
    assert family.hf_fields({"model_type": "qwen2", "sliding_window": 8})["sliding_window"] is None  # not used


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "gemma"}, r"unsupported model_type 'gemma'"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"unsupported rope_scaling type 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, r"rope_scaling 'yarn' lacks factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, r"rope_scaling factor 0.5"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
      "num_hidden_layers": 2}, r"use_sliding_window with windowed and full layers mixed"),
    ({"model_type": "mistral", "sliding_window": 0}, r"sliding_window must be a positive integer"),
    ({"model_type": "mistral", "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
     r"sliding_window with windowed and full layers mixed \(layer_types\)"),
    ({"model_type": "mistral", "sliding_window": 16, "layer_types": "sliding"}, r"layer_types must be a list"),
    # both RoPE forms, saying different things (HF reads rope_scaling and the top-level theta; minillama read
    # rope_parameters)
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_parameters \(linear, factor 4.0, rope_theta 10000.0\) and rope_scaling \(yarn, .*\) disagree"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "rope_scaling": {"type": "linear", "factor": 4.0}},
     r"rope_parameters \(default, rope_theta 500000.0\) and rope_scaling \(linear, factor 4.0, rope_theta 10000.0"),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
      "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
     r"rope_parameters \(linear, factor 2.0, rope_theta 500000.0\) and rope_scaling \(linear, factor 2.0, rope_theta "
     r"10000.0\) disagree"),
    ({"rope_parameters": {"rope_type": "yarn", "type": "linear", "factor": 4.0, "original_max_position_embeddings": 8},
      "rope_scaling": {"type": "linear", "factor": 4.0}}, r"rope_parameters \(yarn, .*\) and rope_scaling \(linear"),
    ({"partial_rotary_factor": 0.5, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"partial_rotary_factor != 1 \(partial RoPE\) is not supported"),
    ([1, 2], r"a config must be a JSON object"),
    ({"architectures": ["GPTNeoXForCausalLM"]}, r"config.json has no model_type and its architectures "
                                                r"\['GPTNeoXForCausalLM'\] name no model minillama runs"),
    ({"architectures": [["LlamaForCausalLM"]]}, r"its architectures \[\['LlamaForCausalLM'\]\] name no model"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     r"quantized weights \(quantization_config, quant_method 'gptq'\) are not supported"),
])
def test_what_is_not_implemented_is_refused_in_one_line_naming_the_field(tmp_path, fields, match):
    p = tmp_path / "config.json"
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    p.write_text(json.dumps(fields if isinstance(fields, list) else {**base, **fields}))
    with pytest.raises(WeightsError, match=match) as e:
        hf_config(p)
    assert "\n" not in str(e.value)


def test_both_rope_forms_saying_the_same_are_read():
    """rope_parameters beside a rope_scaling (and top-level theta) that agree with it: one RoPE, either spelling."""
    d = {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}, "rope_theta": 5e5,
         "rope_scaling": {"type": "linear", "factor": 4.0}}
    c = LlamaConfig.from_dict(family.hf_fields(d))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0} and c.rope_theta == 5e5


def test_llama3_gguf_with_one_frequency_in_the_band(tmp_path):
    """llama.cpp's rope_freqs with a single interpolated frequency: read, reproduced, and equal to HF."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    theta, head_dim = 10000.0, 16
    factors = llama3_rope_factors(scaling, head_dim, theta)
    band = ((factors > 1) & (factors < 8)).sum()
    assert band == 1, band  # the case this test is about
    got = llama3_scaling_from_factors(factors, head_dim, theta, "x.gguf")
    assert np.allclose(llama3_rope_factors(got, head_dim, theta), factors, rtol=1e-6, atol=0)
    # and no band at all (factor 8, a band narrower than one frequency step)
    narrow = {**scaling, "low_freq_factor": 2.0, "high_freq_factor": 2.2}
    f0 = llama3_rope_factors(narrow, head_dim, theta)
    assert ((f0 > 1) & (f0 < 8)).sum() == 0
    assert np.allclose(llama3_rope_factors(llama3_scaling_from_factors(f0, head_dim, theta, "x"), head_dim, theta), f0)

    # End to end: HF Llama with this scaling against the GGUF llama.cpp writes (rope_freqs beside the weights).
    CASES["llama3-one-band"] = ("LlamaConfig", dict(rope_scaling=scaling, head_dim=head_dim, num_attention_heads=4,
                                                    num_key_value_heads=2))
    try:
        model = hf_checkpoint("llama3-one-band", tmp_path / "hf")
    finally:
        del CASES["llama3-one-band"]
    config, sd = load_state_dict(tmp_path / "hf")
    path = write_gguf(tmp_path / "l3.gguf", config, sd, None, rope_freqs=factors)
    loaded, _ = load_state_dict(path)
    assert loaded.rope_scaling["rope_type"] == "llama3"
    diff, same_argmax = compare(model, path)
    assert diff <= 1e-5 and same_argmax, diff


def test_conversions_of_the_family_load_in_transformers(tmp_path):
    """`weights convert` of a Qwen3 and a windowed Mistral writes a directory HF reads as the same model."""
    from minillama import weights
    from minillama.weights import convert

    for name in ("qwen3-head-dim-8-bias", "mistral-window-40", "qwen2-window-all-layers"):
        model = hf_checkpoint(name, tmp_path / name)
        (tmp_path / name / "tokenizer.json").write_text(_tiny_tokenizer_json())
        out = convert(tmp_path / name, tmp_path / f"{name}-conv")
        again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        ids = torch.randint(3, 101, (1, SEQ), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(again(ids).logits, model(ids).logits), name
        assert weights.info(out)["config"]["model_type"] == name.split("-")[0]


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(101)}, unk_token="t0")).to_str()


def test_yarn_attention_factor_is_hfs():
    from minillama.rope import attention_scaling

    c = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=YARN)
    assert attention_scaling(c) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    c = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={**YARN, "attention_factor": 1.5})
    assert attention_scaling(c) == 1.5


def test_the_qwen2_gguf_layout_is_the_one_transformers_reads(tmp_path):
    """The test writer's qwen2 layout (rotate-half Q/K, biases as `attn_*.bias`) checked by an independent
    reader: transformers' own GGUF loader gives back HF's model. (Its loader drops llama biases, ignores
    RoPE scaling and misreads Qwen3's head_dim, so it checks only this architecture.)"""
    from _ckpt_writers import byte_bpe_tokenizer, gguf_tokenizer_metadata

    saved = BASE["vocab_size"]
    BASE["vocab_size"] = 320  # the tokenizer's vocabulary, which transformers' loader needs
    try:
        model = hf_checkpoint("qwen2", tmp_path / "hf")
    finally:
        BASE["vocab_size"] = saved
    config, sd = load_state_dict(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(byte_bpe_tokenizer(vocab=320)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, 320, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (theirs(ids).logits - model(ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rope, extra, match", [
    (YARN, {"llama.rope.scaling.yarn_log_multiplier": 0.1}, r"rope\.scaling\.yarn_log_multiplier 0\.1"),
    (YARN, {"llama.rope.scaling.attn_factor": 1.5}, r"rope\.scaling\.attn_factor 1\.5"),
    (None, {"llama.rope.scaling.type": "longrope"}, r"rope\.scaling\.type 'longrope' is not supported"),
    (None, {"llama.attention.sliding_window": 64}, r"llama\.attention\.sliding_window is not supported"),
])
def test_gguf_fields_minillama_does_not_implement_are_refused_in_one_line(tmp_path, rope, extra, match):
    config = LlamaConfig(**BASE, rope_scaling=rope)
    sd = {k: torch.ones(s) for k, s in expected_shapes(config).items()}
    path = write_gguf(tmp_path / "m.gguf", config, sd, None, extra=extra)
    with pytest.raises(WeightsError, match=match) as e:
        load_state_dict(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 3.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_a_top_level_pretraining_length_wins_as_in_transformers(tmp_path, rope):
    """config.json's top-level original_max_position_embeddings (where Phi-3 writes it) was ignored for the
    nested one (or the context): logits off by several units from HF's, which gives the top level priority."""
    from minillama.weights import load_state_dict

    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_parameters={"rope_theta": 10000.0, **rope})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "original_max_position_embeddings": 24}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    config, sd = load_state_dict(tmp_path)
    assert config.rope_scaling["original_max_position_embeddings"] == 24
    ids = torch.randint(3, 101, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(build_model(config, sd)(ids), ref(ids[None]).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("extra, want", [
    ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, {"rope_type": "linear", "factor": 1.0}),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.type": "none", "llama.rope.scale_linear": 4.0}, None),
])
def test_gguf_rope_scaling_reads_as_llama_cpp_reads_it(tmp_path, extra, want):
    """A GGUF's factor with no scaling type is linear, and an explicit type "none" never scales, whatever
    factor stands beside it (a factor of 0 is no scaling): as llama.cpp, whose format it is, runs the file.
    An explicit "none" beside a factor was scaled linearly before."""
    config = LlamaConfig(**BASE)
    sd = {k: torch.ones(s) for k, s in expected_shapes(config).items()}
    got, _ = load_state_dict(write_gguf(tmp_path / "m.gguf", config, sd, None, extra=extra))
    assert got.rope_scaling == want


def test_yarn_over_its_own_context_answers_to_original_times_factor(tmp_path):
    """YaRN added over `max_position_embeddings` itself (Qwen2.5's model card: factor 4 over 32,768) was refused
    past that length, where HF runs on (no bound) and the factor says the model answers four times as far. The
    context is now the pretraining length times the factor: a document past 64 positions answers in parallel
    as each question does alone, to the bit; position 256 is refused."""
    from minillama.generate import SamplingParams, generate
    from test_parity import assert_same_answers

    hf_checkpoint("qwen2-yarn-past-its-context", tmp_path / "hf")
    model = build_model(*load_state_dict(tmp_path / "hf"))
    assert (model.config.max_position_embeddings, model.config.context) == (64, 256)
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 101, (120,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 101, (n,), generator=g).tolist() for n in (5, 9, 14)]
    params = SamplingParams(max_new_tokens=6, keep_logits=True, ignore_eos=True)
    assert_same_answers(generate(model, prompts, params, mode="independent"), generate(model, prompts, params))
    with pytest.raises(ValueError, match=r"position 256 is beyond the model's context \(256 positions"):
        model(torch.arange(257) % 100 + 1)

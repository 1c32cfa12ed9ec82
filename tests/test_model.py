"""The model against a textbook float64 forward and against HF transformers; cached decoding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.model import Llama
from reference import reference_logits
from tiny import configs, tiny_config, tiny_model


@settings(max_examples=25, deadline=None)
@given(config=configs(), seed=st.integers(0, 100), n=st.integers(1, 200))
def test_matches_textbook_float64(config, seed, n):
    model = tiny_model(config, seed)
    tokens = torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    expected = reference_logits({k: v.cpu() for k, v in model.state_dict().items()}, config, tokens)  # on the CPU
    got32 = model(torch.tensor(tokens)).double().cpu()
    torch.testing.assert_close(got32, expected, atol=1e-4, rtol=1e-4)
    got64 = model.double()(torch.tensor(tokens)).cpu()
    torch.testing.assert_close(got64, expected, atol=1e-10, rtol=1e-10)


def test_cached_decoding_equals_recomputation():
    config = tiny_config(layers=2, heads=6, kv_heads=3, head_dim=16)
    model = tiny_model(config, 3)
    tokens = torch.randint(3, config.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    cache = model.new_cache()
    seg = cache.new_segment()
    steps = [model(tokens[:70], torch.arange(70), torch.full((70,), seg), cache)]
    for i in range(70, 150):  # one token at a time, each seeing only the cache
        steps.append(model(tokens[i:i + 1], torch.tensor([i]), torch.tensor([seg]), cache))
    assert torch.equal(torch.cat(steps), full)


def test_chunked_prefill_gives_the_same_cache_bits():
    config = tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8)
    model = tiny_model(config, 4)
    tokens = torch.randint(3, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    caches = []
    for chunk in (300, 64, 37, 1):
        cache = model.new_cache(400)
        seg = cache.new_segment()
        for lo in range(0, 300, chunk):
            hi = min(lo + chunk, 300)
            model(tokens[lo:hi], torch.arange(lo, hi), torch.full((hi - lo,), seg), cache)
        slots = torch.tensor(cache.segments[seg].slots)
        caches.append((cache.k[:, :, slots], cache.v[:, :, slots]))
    for k, v in caches[1:]:
        assert torch.equal(k, caches[0][0]) and torch.equal(v, caches[0][1])


def _hf_model(config, model):
    transformers = pytest.importorskip("transformers")  # a test dependency, installed by .ci/run
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "architectures"},
                                         attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("kw", [
    dict(heads=4, kv_heads=4, head_dim=16),  # MHA
    dict(heads=6, kv_heads=2, head_dim=8, theta=500000.0, llama3=True),  # GQA, Llama-3 RoPE scaling
    dict(heads=9, kv_heads=3, head_dim=8, tied=True, layers=3),  # SmolLM2's head layout, tied head
])
def test_matches_hf_transformers(kw):
    config = tiny_config(**kw, max_pos=512)
    model = tiny_model(config, 7)
    hf = _hf_model(config, model)
    tokens = torch.randint(3, config.vocab_size, (1, 180), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits[0]
    torch.testing.assert_close(model(tokens[0]).cpu(), expected, atol=1e-5, rtol=0)  # HF on the CPU


def test_forward_rejects_bad_positions_and_segments():
    model = tiny_model(tiny_config(), 0)
    cache = model.new_cache()
    seg = cache.new_segment()
    model(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([seg, seg]), cache)
    with pytest.raises(ValueError, match="expects position 2, got 3"):
        model(torch.tensor([7]), torch.tensor([3]), torch.tensor([seg]), cache)
    with pytest.raises(KeyError, match="segment 99 does not exist"):
        model(torch.tensor([7]), torch.tensor([2]), torch.tensor([99]), cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.tensor([7]), torch.tensor([5000]), torch.tensor([seg]), model.new_cache())


def test_weights_are_laid_out_for_their_products():
    """The row-split projections (o, down) are column-major at every unit count. The column-split ones (q, k,
    v, gate, up) are column-major too on a CPU in float32 at every unit count (oneDNN's linear reads them
    faster so; several units run as one product where proven, proofs.proven_units), else row-major; the LM
    head keeps its layout. The values and a forward pass's logits never change with the layout."""
    model = tiny_model(tiny_config(tied=False))
    x = torch.arange(12) % 50
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def logits():
        cache = model.new_cache(16)
        seg = cache.new_segment()
        return model(x, torch.arange(12), torch.full((12,), seg), cache)

    def layout(name: str) -> str:
        w = model.get_parameter(name)
        return "column" if w.stride() == (1, w.shape[0]) else "row" if w.is_contiguous() else "other"

    ones = logits()
    qkv = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    rows = ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
    assert [layout(n) for n in qkv + rows + ["lm_head.weight"]] == ["column" if cpu32 else "row"] * 2 + ["column"] * 2 + ["row"]
    model.units = 2
    assert [layout(n) for n in qkv + rows + ["lm_head.weight"]] == ["column" if cpu32 else "row"] * 2 + ["column"] * 2 + ["row"]
    model.units = 1
    assert [layout(n) for n in qkv] == ["column" if cpu32 else "row"] * 2
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(), ones)
    model.to(torch.bfloat16)  # the layout follows the dtype (and the device) a model is moved to
    assert [layout(n) for n in qkv] == ["row"] * 2 and layout(rows[0]) == "column"
    model.to(torch.float32)
    assert [layout(n) for n in qkv] == ["column" if model.device.type == "cpu" else "row"] * 2


@pytest.mark.parametrize("intermediate", [1, 3])
def test_more_units_than_mlp_features_leave_a_unit_empty_and_keep_parity(intermediate):
    """units = the KV heads (what loading sets) may exceed an MLP of fewer features: a unit then holds no
    feature, and the down projection's product over it is an empty sum, which oneDNN's linear refused
    (RuntimeError) where torch.mm gives zeros. Now it is zeros: the logits are the one unit's but for the
    order of the units' sum, and parallel still equals independent."""
    from minillama.generate import SamplingParams, generate

    config = tiny_config(layers=1, heads=4, kv_heads=4, head_dim=8)
    config.intermediate_size = intermediate
    model = tiny_model(config, seed=0, tiles=None)
    x = torch.tensor([5, 6, 7])
    whole = model(x)
    prompts = [[5, 6, 7, 8] * 20 + [9], [5, 6, 7, 8] * 20 + [10, 11]]
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    for units in (2, 4):
        model.units = units
        torch.testing.assert_close(model(x), whole, rtol=1e-5, atol=1e-5)
        alone = generate(model, prompts, params, mode="independent")
        packed = generate(model, prompts, params, mode="parallel")
        assert all(torch.equal(torch.stack(a.logits), torch.stack(b.logits)) for a, b in zip(alone, packed))


BAD_PASSES = {  # what the pass is given instead, and what it is refused with, before the cache gives it slots
    "a token past the vocabulary": ({"tokens": torch.tensor([5, 61, 7])}, "token id 61 is outside the vocabulary"),
    "a negative token": ({"tokens": torch.tensor([5, -1, 7])}, "token id -1 is outside the vocabulary"),
    "float tokens": ({"tokens": torch.tensor([5.0, 6.0, 7.0])}, "tokens must be integers, got torch.float32"),
    "float positions": ({"positions": torch.arange(3, 6).float()}, "positions must be integers"),
    "bool segments": ({"segments": torch.ones(3, dtype=torch.bool)}, "segments must be integers, got torch.bool"),
    "a logits row past the pass": ({"logits_rows": torch.tensor([3])}, r"logits_rows must be rows of this pass, 0 \.\. 2"),
    "a negative logits row": ({"logits_rows": torch.tensor([-1])}, "logits_rows must be rows of this pass"),
    "a cache of another dtype": ({"cache": "float64"}, "is not this model's"),
    "a cache of another model": ({"cache": "one layer"}, "is not this model's"),
    "a list of tokens": ({"tokens": [5, 6, 7]}, r"tokens must be a tensor \(torch.tensor\(...\)\), got list"),
    "a list of positions": ({"positions": [3, 4, 5]}, "positions must be a tensor"),
    "a cache that is not one": ({"cache": {}}, "cache must be a KVCache"),
}


@pytest.mark.parametrize("case", list(BAD_PASSES))
def test_a_bad_pass_is_refused_before_the_cache_changes(case):
    """Each had failed deep in the model after the cache gave the tokens slots (a retry then found its
    positions taken, and a pass that went on attended to zero keys), or had answered wrong (a row past the
    pass, a foreign cache's dtype). Refused at the call; the same pass given right then has the bits of one
    fresh pass over all the tokens (prefill == decode), so the cache was left as it was."""
    from minillama.cache import KVCache

    config = tiny_config()
    model = tiny_model(config)
    cache = model.new_cache(16)
    root = cache.new_segment()
    model(torch.arange(3), torch.arange(3), torch.full((3,), root), cache)
    given = {"tokens": torch.tensor([5, 6, 7]), "positions": torch.arange(3, 6), "segments": torch.full((3,), root),
             "cache": cache, "logits_rows": None}
    change, says = BAD_PASSES[case]
    given.update(change)
    if given["cache"] == "float64":
        given["cache"] = KVCache(config, 16, dtype=torch.float64)
    elif given["cache"] == "one layer":
        given["cache"] = KVCache(tiny_config(layers=1), 16)
    if isinstance(given["cache"], KVCache) and given["cache"] is not cache:
        given["cache"].new_segment()
    with pytest.raises((TypeError, ValueError), match=says):
        model(**given)
    again = model(torch.tensor([5, 6, 7]), torch.arange(3, 6), torch.full((3,), root), cache)
    assert torch.equal(again, model(torch.tensor([0, 1, 2, 5, 6, 7]))[3:])


FIRST_PASSES = {  # a cache's first pass, given no segments: what it is refused with, before it makes its segment
    "a token past the vocabulary": ({"tokens": torch.tensor([1, 200])}, "token id 200 is outside the vocabulary"),
    "a position past the context": ({"tokens": torch.ones(17, dtype=torch.long)}, "position 16 is beyond"),
    "positions that do not start at 0": ({"positions": torch.arange(3, 5)}, r"at positions 0 \.\. 1, got \[3, 4\]"),
    "a logits row past the pass": ({"logits_rows": torch.tensor([2])}, "logits_rows must be rows of this pass"),
    "a cache of another model": ({"cache": "one layer"}, "is not this model's"),
}


@pytest.mark.parametrize("case", list(FIRST_PASSES))
def test_a_bad_first_pass_without_segments_leaves_the_cache_empty(case):
    """With a cache and no segments the pass makes its tokens' segment: it did so before its checks, so a
    refused pass left an empty segment behind, and the same pass given right then was refused as "segments are
    required with a cache that already holds segments"."""
    from minillama.cache import KVCache

    model = tiny_model(tiny_config(max_pos=16))
    given = {"tokens": torch.tensor([1, 2]), "positions": None, "cache": model.new_cache(), "logits_rows": None}
    change, says = FIRST_PASSES[case]
    given.update(change)
    if given["cache"] == "one layer":
        given["cache"] = KVCache(tiny_config(layers=1, max_pos=16), 16)
    with pytest.raises(ValueError, match=says):
        model(**given)
    assert given["cache"].segments == {}
    cache = model.new_cache()
    assert torch.equal(model(torch.tensor([1, 2]), cache=cache), model(torch.tensor([1, 2])))


def test_invariant_takes_a_bool_only():
    model = tiny_model(tiny_config())
    for bad in ("False", [0], 0):
        with pytest.raises(TypeError, match="invariant must be True or False"):
            model.invariant = bad
    assert model.invariant is True

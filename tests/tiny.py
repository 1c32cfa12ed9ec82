"""Tiny random Llama models and packed layouts for the tests.

Tests run on the device named by `MINILLAMA_TEST_DEVICE` (default `cpu`; `cuda` on a GPU machine): the
factories here put models there, and the parity, attention and model tests run unchanged.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from hypothesis import strategies as st

from minillama.config import LlamaConfig
from minillama.blocks import AttentionTiles, ItemTiles
from minillama.invariant import Tiles
from minillama.model import Llama

VOCAB = 61
DEVICE = torch.device(os.environ.get("MINILLAMA_TEST_DEVICE", "cpu"))
# Small tiles for tiny models: the same code paths as the default tiles with a fraction of the padding, and
# chunks of a few items, so that a short document already takes the chunked path (scores computed twice).
# Short tiles of 4 and 8 rows stand in for a pass's last tile where proven (proofs.proven_short), and short
# batches of 2 whole items, 4 or 8 partial ones, for a kind's last batch (batched.proven_batches); runs of 2
# and 4 whole tiles go as one long product where proven (proofs.proven_long).
SMALL_TILES = Tiles(rows=16, attention=AttentionTiles(whole=ItemTiles(rows=16, batch=4, chunk=8, short=(2,)),
                                                   partial=ItemTiles(rows=4, batch=16, chunk=32, short=(4, 8))),
                    short=(4, 8), long=(64, 32))
# The same with each item's softmax taken by torch's fused CPU attention kernel (AttentionTiles.fused): a CPU's
# kernel, so only where the tests run on a CPU.
FUSED_TILES = Tiles(rows=16, attention=dataclasses.replace(SMALL_TILES.attention, fused=True))
ON_CPU = [FUSED_TILES] if DEVICE.type == "cpu" else []


# RoPE scalings for the property: (name, rope_scaling).
ROPES = {"none": None, "linear": {"rope_type": "linear", "factor": 4.0},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}


def tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8, theta=10000.0, llama3=False, tied=False,
                vocab=VOCAB, max_pos=2048, model_type="llama", attention_bias=False, mlp_bias=False,
                window=None, rope="none") -> LlamaConfig:
    scaling = ROPES[rope]
    if llama3:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    return LlamaConfig(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=tied, max_position_embeddings=max_pos,
        bos_token_id=1, eos_token_id=2, model_type=model_type, attention_bias=attention_bias, mlp_bias=mlp_bias,
        sliding_window=window,
    )


def tiny_model(config: LlamaConfig, seed: int = 0, dtype=torch.float32, tiles: Tiles | None = SMALL_TILES) -> Llama:
    """Random weights, norms included, scaled so that logits are spread out (argmax ties are rare).

    On the test device; `tiles=None` takes the device's default tiles (the ones users run).
    """
    g = torch.Generator().manual_seed(seed)
    model = Llama(config, tiles=tiles)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.to(DEVICE, dtype)


@st.composite
def configs(draw) -> LlamaConfig:
    """Llama with or without Llama-3 scaling, about half the time one of the family (family.py): Mistral
    with windows that cut blocks anywhere, Qwen2, Qwen3, biases, linear and yarn RoPE."""
    kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3]))  # 1: MHA
    model_type = draw(st.sampled_from(["llama", "llama", "mistral", "qwen2", "qwen3"]))
    rope = "none" if model_type == "llama" and draw(st.booleans()) else draw(st.sampled_from(sorted(ROPES)))
    return tiny_config(
        layers=draw(st.integers(1, 3)), heads=kv * group, kv_heads=kv,
        head_dim=draw(st.sampled_from([4, 6, 8, 10, 16])),  # 6 and 10: values products narrower than a vector
        theta=draw(st.sampled_from([10000.0, 500000.0, 100.0])), llama3=rope == "none" and draw(st.booleans()),
        tied=draw(st.booleans()), model_type=model_type, rope=rope,
        attention_bias=model_type in ("llama", "qwen3") and draw(st.booleans()),
        mlp_bias=model_type == "llama" and draw(st.booleans()),
        window=draw(st.sampled_from([1, 5, 63, 64, 65, 100, 200])) if model_type == "mistral" else None,
    )


def ids(draw, lo: int, hi: int) -> list[int]:
    return draw(st.lists(st.integers(3, VOCAB - 1), min_size=lo, max_size=hi))

"""Named model shapes for random-weight runs, and the random weights."""

from __future__ import annotations

import torch

from ..config import LlamaConfig
from ..model import Llama


def random_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    """Random weights (std 0.02, norms 1): the speed of a real model, none of its answers."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


SMOLLM2_SHAPE = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                            tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
TINY_SHAPE = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
# Llama-3-8B's shape (rope scaling left out: the speed is the same, and no checkpoint is read).
LLAMA3_8B_SHAPE = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                              tie_word_embeddings=False, max_position_embeddings=8192, bos_token_id=128000,
                              eos_token_id=128009)
# Llama-3.2-1B (rope scaling left out, as above) and SmolLM2-360M: the 1B class people run on a CPU.
LLAMA32_1B_SHAPE = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                               rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
                               bos_token_id=128000, eos_token_id=128009)
SMOLLM2_360M_SHAPE = LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                 num_attention_heads=15, num_key_value_heads=5, head_dim=64, rms_norm_eps=1e-5,
                                 rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
                                 bos_token_id=1, eos_token_id=2)
SHAPES = {"llama3-8b": LLAMA3_8B_SHAPE, "llama3.2-1b": LLAMA32_1B_SHAPE, "smollm2": SMOLLM2_SHAPE,
          "smollm2-360m": SMOLLM2_360M_SHAPE, "tiny": TINY_SHAPE}

"""The one layout every reader returns: HF LlamaForCausalLM tensor names, HF's rotate-half RoPE order.

Here: the error every reader raises (`WeightsError`), the name maps from Meta and GGUF names to HF's (they
raise on tensors they do not know), the shapes a config
implies, and the one Q/K permutation (`interleaved_to_half`, tested by logits equality with HF
transformers) that brings Meta's and llama.cpp's interleaved RoPE rows to rotate-half order.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from minillama.config import LlamaConfig
from minillama.errors import OneLineError

from .shard import Slices, sliced_shape

StateDict = dict[str, torch.Tensor]


class WeightsError(OneLineError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Q or K projection from interleaved RoPE order to rotate-half order.

    Meta's and llama.cpp's RoPE rotate adjacent pairs (x[2j], x[2j+1]) of each head; HF's (and
    minillama's) rotate (x[j], x[j + D/2]). Reading each head's D rows as (D/2, 2) and writing them as
    (2, D/2) moves row 2j to j and row 2j+1 to D/2 + j, so the same weights give the same attention.
    n_heads: query heads for Q, key/value heads for K. w: (n_heads * D, hidden), or a bias (n_heads * D,).
    """
    rows, rest = w.shape[0], tuple(w.shape[1:])
    # (rows, *rest) -> (H, D/2, 2, *rest) -> (H, 2, D/2, *rest) -> (rows, *rest)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _unpermute_qk(name: str, t: torch.Tensor, c: LlamaConfig) -> torch.Tensor:
    """Q and K rows (weights and biases) to rotate-half order. Only `llama` is stored interleaved: llama.cpp
    runs qwen2 and qwen3 with rotate-half ("NeoX") RoPE, so their converter keeps HF's order."""
    if c.model_type != "llama":
        return t
    if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return interleaved_to_half(t, t.shape[0] // c.head_dim)  # every head, or a rank's whole heads
    return t


# Source name -> HF name; "{i}" is the layer index. None: a known tensor minillama does not need
# (it is derived from the config).
META_NAMES: dict[str, str | None] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope.freqs": None,
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
}
GGUF_NAMES: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,  # Llama 3 RoPE factors; read into config.rope_scaling
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # The family (family.py): biases, Qwen3's per-head q/k norms.
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
# HF checkpoints already use HF names; older ones also carry RoPE's inverse frequencies.
HF_NAMES: dict[str, str | None] = {n: n for n in GGUF_NAMES.values() if n is not None}
HF_NAMES["model.layers.{i}.self_attn.rotary_emb.inv_freq"] = None


def map_name(name: str, table: dict[str, str | None], source: str | Path) -> str | None:
    """The HF name for a source tensor name, None for a known tensor to drop; raises on unknown names."""
    m = re.search(r"\.(\d+)\.", name)
    key = name.replace(m.group(0), ".{i}.", 1) if m else name
    if key not in table:
        raise WeightsError(f"{source}: unexpected tensor {name!r} (not a Llama weight minillama knows)")
    target = table[key]
    return None if target is None else target.format(i=m.group(1)) if m else target


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama with this config has, and its shape (lm_head only when not tied)."""
    E, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (q, E), p + "self_attn.k_proj.weight": (kv, E),
            p + "self_attn.v_proj.weight": (kv, E), p + "self_attn.o_proj.weight": (E, q),
            p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E),
            p + "mlp.down_proj.weight": (E, F),
        })
        if c.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (E,)
        if c.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (F,), p + "mlp.up_proj.bias": (F,),
                           p + "mlp.down_proj.bias": (E,)})
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
    return shapes


def check_state_dict(config: LlamaConfig, sd: StateDict, source: str | Path, slices: Slices | None = None) -> None:
    """Raise unless `sd` holds exactly the tensors `config` describes, in their shapes (cut to `slices`)."""
    want = {name: sliced_shape(shape, (slices or {}).get(name)) for name, shape in expected_shapes(config).items()}
    for name, t in sd.items():
        if name not in want:
            raise WeightsError(f"{source}: unexpected tensor {name!r} for this config")
        if not t.is_floating_point():
            raise WeightsError(f"{source}: tensor {name} holds {str(t.dtype).removeprefix('torch.')}; "
                               "weights must be floating point")
        if tuple(t.shape) != want[name]:
            raise WeightsError(f"{source}: tensor {name} has shape {tuple(t.shape)} but the config "
                               f"implies {want[name]} (config and weights do not match)")
    missing = [n for n in want if n not in sd]
    if missing:
        raise WeightsError(f"{source}: missing tensor {missing[0]!r}" +
                           (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

"""A textbook Llama forward for one unpacked prompt: dense causal attention, float64, no cache, no tiles.

Written from the equations, independently of minillama's kernels, to check them for correctness. The
family's switches (family.py) come from the data: biases and q/k norms where the state dict has them, the
sliding window from the config.
"""

from __future__ import annotations

import math

import torch


def reference_logits(state: dict[str, torch.Tensor], config, tokens: list[int]) -> torch.Tensor:
    sd = {k: v.double() for k, v in state.items()}
    h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n = len(tokens)

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps)

    # RoPE written with complex numbers: pair (i, i + D/2) is the complex number x_i + j x_{i+D/2}.
    from minillama.rope import attention_scaling, inv_frequencies  # the frequencies and yarn's factor: data

    freqs = inv_frequencies(config).double()
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]  # (N, D/2)
    rot = torch.polar(torch.full_like(angle, attention_scaling(config)), angle)

    def lin(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    def head_norm(x, name):  # Qwen3: RMSNorm over each head's D values
        return rms(x, sd[name]) if name in sd else x

    def rope(x):  # (N, heads, D)
        c = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot[:, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if config.sliding_window is not None:  # key visible iff query - key < window
        causal &= ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-config.sliding_window)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = rope(head_norm(lin(a, p + "self_attn.q_proj").view(n, h, d), p + "self_attn.q_norm.weight"))
        k = rope(head_norm(lin(a, p + "self_attn.k_proj").view(n, hkv, d), p + "self_attn.k_norm.weight"))
        v = lin(a, p + "self_attn.v_proj").view(n, hkv, d)
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(n, h * d)
        x = x + lin(att, p + "self_attn.o_proj")
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = lin(m, p + "mlp.gate_proj")
        up = lin(m, p + "mlp.up_proj")
        x = x + lin(gate * torch.sigmoid(gate) * up, p + "mlp.down_proj")
    x = rms(x, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ head.T

"""A textbook Llama forward for one unpacked prompt: dense causal attention, float64, no cache, no tiles.

Written from the equations, independently of minillama's kernels, to check them for correctness.
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
    from minillama.rope import inv_frequencies  # the frequencies only (Llama-3 scaling is data)

    freqs = inv_frequencies(config).double()
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]  # (N, D/2)
    rot = torch.polar(torch.ones_like(angle), angle)

    def rope(x):  # (N, heads, D)
        c = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot[:, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = rope((a @ sd[p + "self_attn.q_proj.weight"].T).view(n, h, d))
        k = rope((a @ sd[p + "self_attn.k_proj.weight"].T).view(n, hkv, d))
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(n, hkv, d)
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(n, h * d)
        x = x + att @ sd[p + "self_attn.o_proj.weight"].T
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = m @ sd[p + "mlp.gate_proj.weight"].T
        up = m @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ head.T

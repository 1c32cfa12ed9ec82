"""Rotary position embeddings (RoFormer), in the rotate-half layout that HF Llama uses.

A pair (x_i, x_{i+D/2}) of a head vector is rotated by the angle `position * inv_freq[i]`. The angle depends
only on the token's own position, so RoPE is applied per token from the `positions` tensor: a question's
tokens, whose positions continue from the end of their document, are rotated exactly as in their
stand-alone prompt. Llama 3's frequency scaling (rope_type "llama3") follows HF's
`_compute_llama3_parameters`.
"""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig


def inv_frequencies(config: LlamaConfig) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, with Llama-3 scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (N, D) for N token positions; each row depends on its position alone.

    Angles are computed in float32 as HF does (float64 for a float64 model).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(work)[:, None] * inv_freq.to(positions.device, work)[None, :]  # (N, D/2)
    emb = torch.cat([angles, angles], dim=-1)  # (N, D): rotate-half pairs i and i + D/2
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, H, D); cos, sin: (N, D). Returns x rotated by each token's angle."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate-half's minus sign folded into its first half: (N, D) -> (N, D)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope_folded(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the sign already in the sine table (`signed_sin`): one launch fewer per call.

    The same bits: rotate_half(x) * sin multiplies (-x2) by sin, this multiplies x2 by (-sin), and IEEE
    products differ only in sign when one factor's sign flips.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([x2, x1], dim=-1) * sin_signed[:, None, :]

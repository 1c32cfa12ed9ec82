"""Rotary position embeddings (RoFormer), in the rotate-half layout that HF Llama uses.

A pair (x_i, x_{i+D/2}) of a head vector is rotated by the angle `position * inv_freq[i]`. The angle depends
only on the token's own position, so RoPE is applied per token from the `positions` tensor: a question's
tokens, whose positions continue from the end of their document, are rotated exactly as in their
stand-alone prompt. The scalings follow HF's `modeling_rope_utils`: "llama3"
(`_compute_llama3_parameters`), "linear" (every frequency divided by the factor), "yarn" (frequencies
blended by a ramp, cos and sin multiplied by an attention factor) and "dynamic". HF's dynamic NTK rescales
only once a forward pass reaches past `max_position_embeddings`, with frequencies that follow that pass's
length; within the context its frequencies are the default ones, and minillama never runs past the context
(a position beyond it is refused), so "dynamic" is the default RoPE here.
"""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig


def _kind(config: LlamaConfig) -> str:
    scaling = config.rope_scaling
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def inv_frequencies(config: LlamaConfig) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, scaled as the config's rope_scaling asks."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling, kind = config.rope_scaling, _kind(config)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_inv_frequencies(config)
    if kind != "llama3":  # "default", and "dynamic" within the context (module docstring)
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


def _yarn_inv_frequencies(config: LlamaConfig) -> torch.Tensor:
    """YaRN: interpolated (divided by the factor) below a band of dimensions, kept above it, a linear ramp
    between; the band is where a frequency turns beta_fast .. beta_slow times in the original context."""
    s, d, base = config.rope_scaling, config.head_dim, config.rope_theta
    factor = s["factor"]
    old = s.get("original_max_position_embeddings") or config.max_position_embeddings
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def attention_scaling(config: LlamaConfig) -> float:
    """The factor HF multiplies cos and sin by: YaRN's attention temperature, 1 for the other kinds."""
    if _kind(config) != "yarn":
        return 1.0
    s = config.rope_scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s["factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (N, D) for N token positions, times `scale` (`attention_scaling`); each row
    depends on its position alone.

    Angles are computed in float32 as HF does (float64 for a float64 model).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(work)[:, None] * inv_freq.to(positions.device, work)[None, :]  # (N, D/2)
    emb = torch.cat([angles, angles], dim=-1)  # (N, D): rotate-half pairs i and i + D/2
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


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

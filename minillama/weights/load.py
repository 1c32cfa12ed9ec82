"""Model and tokenizer from a checkpoint: `load_model` (any format, or the default model) and `build_model`
(a minillama `Llama` around a state dict)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Callable, Iterator

import torch

from minillama.config import LlamaConfig
from minillama.tokenizer import Tokenizer, TokenizerError, tokenizer_from_gguf_metadata
from minillama.waves import available_memory

from .default import fetch_default
from .gguf import open_gguf, read_gguf
from .layout import StateDict, WeightsError, check_state_dict
from .read import CHECKPOINT, detect_format, given_path, load_state_dict, load_tokenizer, read_config
from .shard import Slices


def build_model(config: LlamaConfig, state_dict: StateDict, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A minillama `Llama` holding these weights, in eval mode. The tensors are assigned, not copied,
    so a float32 safetensors file loaded on CPU stays memory-mapped. Its products are issued in the default
    units, one per KV head (`Llama.units`), as every entry point issues them: the command line, the API, the
    server and the oracle give the same bits, and so does every tensor-parallel degree dividing the KV heads."""
    from minillama.model import Llama

    check_state_dict(config, {k: v for k, v in state_dict.items()
                              if not (config.tie_word_embeddings and k == "lm_head.weight")}, "state dict")
    sd = {k: _placed(v, device, dtype, f"state dict: {k}") for k, v in state_dict.items()}
    if config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    with torch.device("meta"), _no_random_init():  # a skeleton, nothing drawn or laid out: each weight assigned next
        model = Llama(config)
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.units = config.num_key_value_heads  # lays the weights out for the units (column_major_)
    return model.eval()


def _placed(t: torch.Tensor, device: str | torch.device, dtype: torch.dtype,
            source: object = "state dict") -> torch.Tensor:
    """A checkpoint tensor on `device`, in `dtype` where it is floating point; `.to` keeps its strides.

    float16 holds magnitudes up to 65504 only: a finite bfloat16 or float32 value past that would become inf
    and every answer NaN, so it is refused, naming the dtypes that hold it (values below float16's smallest
    round towards 0, as any rounding to 16 bits does)."""
    if not t.is_floating_point():
        return t.to(device)
    out = t.to(device=device, dtype=dtype)
    if dtype == torch.float16 and t.dtype != dtype and out.isinf().any():
        wide = t.to(out.device)
        past = out.isinf() & wide.isfinite()
        if past.any():
            big = wide[past].abs().max().item()
            raise WeightsError(f"{source}: a weight of shape {tuple(t.shape)} holds {big:g}, past float16's largest "
                               "value 65504 (it would become inf): load it in bfloat16 or float32")
    return out


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build modules without drawing random initial weights, as every one of them is replaced by a checkpoint
    tensor right after: about a second for 135M parameters on a CPU; on the meta device nothing is drawn, but
    Embedding's initialiser imports torch.distributed.tensor there (~0.6 s)."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn  # type: ignore[method-assign]


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32,
               shard: Callable[[torch.nn.Module], Slices] | None = None) -> tuple[torch.nn.Module, Tokenizer]:
    """Model and tokenizer of a checkpoint: an HF or Meta directory or a .gguf file. Without a path,
    the default model (SmolLM2-135M-Instruct), fetched and converted on first use.

    shard: a tensor-parallel rank's (distributed/tp.py `sharding`): it shards a model skeleton (no weights,
    on the meta device) in place and returns the parts of the split tensors the rank keeps; only those
    parts are read (shard.py), and the model is built around them."""
    path = fetch_default() if path is None else given_path(path, wants=f"{CHECKPOINT}, or none for the default model")
    model, meta = _model_part(path, device, dtype, shard or _laid_out(device, dtype))
    if meta is None:
        return model, load_tokenizer(path)
    try:
        return model, tokenizer_from_gguf_metadata(meta, str(path))
    except TokenizerError as e:
        raise WeightsError(str(e)) from None


def _laid_out(device: str | torch.device, dtype: torch.dtype) -> Callable[[torch.nn.Module], Slices]:
    """For one process (`load_model` without `shard`): the skeleton's units set to the KV heads, as
    `build_model` sets them, and its weights stored column-major on `device` in `dtype` named whole
    (`Llama.column_major_parts`): each is read straight into that layout, so no row-major copy of it, nor the
    memory-mapped pages it was read from, is held beside it (one process's peak was ~280 MB higher so)."""
    def parts(model: torch.nn.Module) -> Slices:
        model.units = model.config.num_key_value_heads
        return model.column_major_parts(device, dtype)

    return parts


def check_room(path: Path, skeleton: torch.nn.Module, device: str | torch.device, dtype: torch.dtype) -> None:
    """WeightsError where the weights this process would hold (`skeleton`'s, on the meta device: a rank's parts
    on a rank) in `dtype` exceed the memory its device has left: a load that cannot finish (on a CPU the
    kernel ends the process part way, without a word, once the memory and swap are spent)."""
    device = torch.device(device)
    if device.type == "cpu":
        left, where = available_memory(), "this machine has"
    elif device.type == "cuda":
        left, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        return
    head = skeleton.lm_head.weight  # tied on a rank: a view of the embedding's rows, no memory of its own
    head = head if skeleton.config.tie_word_embeddings and head is not skeleton.model.embed_tokens.weight else None
    need = sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
               for p in skeleton.parameters() if p is not head)
    if left is not None and need > left:
        size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
        half = "load it in bfloat16 (--dtype bfloat16: half of that) or " if dtype.itemsize == 4 else ""
        raise WeightsError(f"{path}: its weights take {size(need)} in {str(dtype).removeprefix('torch.')} and "
                           f"{where} {size(left)} free, so it cannot load: {half}use a machine with more memory")


def load_model_part(path: str | Path, device: str | torch.device, dtype: torch.dtype,
                    shard: Callable[[torch.nn.Module], Slices]) -> torch.nn.Module:
    """A tensor-parallel rank's model alone (`load_model` with `shard`, no tokenizer read): only its parts of
    the checkpoint are read (the oracle's export, whose prompts may be token ids of a checkpoint without one)."""
    return _model_part(Path(path), device, dtype, shard)[0]


def _model_part(path: Path, device: str | torch.device, dtype: torch.dtype,
                shard: Callable[[torch.nn.Module], Slices]) -> tuple[torch.nn.Module, dict | None]:
    """The sharded model, and a GGUF file's metadata (None for a directory), where its tokenizer is."""
    from minillama.model import Llama

    gguf = open_gguf(path) if detect_format(path) == "gguf" else None  # opened once: slow to parse
    config = read_config(path, gguf)  # off the meta device: deciding a tie may read two tensors (hf_dir_config)
    with torch.device("meta"), _no_random_init():
        model = Llama(config)
    slices = shard(model)
    check_room(path, model, device, dtype)
    meta = None

    # each tensor where it goes as it is read: the peak is about the model's weights and one tensor as read, not
    # the whole checkpoint as read beside them (nor, for a GPU, the whole model in host memory)
    place = functools.partial(_placed, device=device, dtype=dtype, source=path)
    if gguf is not None:
        config, sd, meta = read_gguf(path, slices, gguf, place)
    else:
        config, sd = load_state_dict(path, slices, config, place)
    if config.tie_word_embeddings:  # the head is the embedding, or on a rank a view of its vocabulary rows
        embed, cut = sd["model.embed_tokens.weight"], slices.get("lm_head.weight")
        sd["lm_head.weight"] = embed if cut is None else embed[cut[1]:cut[2]]
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_word_embeddings and "lm_head.weight" not in slices:
        model.lm_head.weight = model.model.embed_tokens.weight  # one parameter, as build_model ties it
    del sd  # the model holds the parts now, so laying them out frees each part it replaces
    return model.column_major_().eval(), meta

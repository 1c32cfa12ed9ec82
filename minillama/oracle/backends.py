"""The backends the oracle runs: minillama itself, HF transformers, llama.cpp (optional), and any
OpenAI-compatible server (server.py).

Each backend answers questions about one sequence of token ids run from position 0, on its own:

    backend.logits(ids)          -> (T, vocab) float32: the logits after every token
    backend.vocab_size()         -> the width of those logits (None where the backend does not say)
    backend.activations(ids)     -> Activations: named intermediate tensors, each (T, F), for the layer diff
    backend.teacher_force(p, a)  -> QuestionRecord: what the backend says at each step of answer `a` after
                                    prompt `p`; by default the logits rows of one pass over p + a[:-1]. A
                                    server that gives log-probs only overrides it.

The oracle feeds a question's prompt followed by the reference's answer (teacher forcing), so a candidate's
logits at every answer step are computed on the reference's context, however early the two greedy answers
part. Token ids go in, never text: tokenizers are compared elsewhere; here only the model is.

Activation names follow HF module paths (a reader finds the module from the name), in forward order:

    embed
    layers.{i}.input_layernorm
    layers.{i}.self_attn.{q,k,v}_proj     Q, K, V projections, before RoPE                    (T, H*D)
    layers.{i}.self_attn.{q,k}_rope       Q and K after RoPE, from the projections and the backend's own
                                          cos/sin tables                                        (T, H*D)
    layers.{i}.self_attn                  attention output, after o_proj
    layers.{i}.post_attention_layernorm
    layers.{i}.mlp
    layers.{i}                            the residual stream after the block
    norm                                  final RMSNorm
    logits

They are captured with forward hooks; nothing in the models is changed. In both models `q_proj`, `k_proj`
and `v_proj` are modules that run, so they are hooked directly; RoPE is no module, so q_rope and k_rope are
the hooked q and k rotated with the model's own RoPE function and tables (the same bits it computes).
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import OneLineError
from ..model import Llama
from ..rope import apply_rope_folded, signed_sin
from .schema import QuestionRecord


class BackendError(OneLineError):
    """A backend that cannot be loaded or run (missing package, unreadable checkpoint, ...)."""


def activation_names(n_layers: int) -> list[str]:
    """Every activation name, in forward order."""
    names = ["embed"]
    for i in range(n_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm", p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj",
                  p + "self_attn.q_rope", p + "self_attn.k_rope", p + "self_attn", p + "post_attention_layernorm",
                  p + "mlp", f"layers.{i}"]
    return names + ["norm", "logits"]


def kind_of(name: str) -> str:
    """The sub-module an activation name belongs to: embedding, norm, attention, RoPE, MLP, residual, lm_head."""
    last = name.rsplit(".", 1)[-1]
    if name == "embed":
        return "embedding"
    if last.endswith("norm"):
        return "norm"
    if last.endswith("_rope"):
        return "RoPE"
    if last.endswith("_proj") or last == "self_attn":
        return "attention"
    if last == "mlp":
        return "MLP"
    if name == "logits":
        return "lm_head"
    return "residual"


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


@dataclass
class Activations:
    tensors: dict[str, torch.Tensor]  # name -> (T, F) float32 on the CPU
    cos: torch.Tensor | None = None  # (T, D): the rotation table the backend used, for RoPE diagnosis
    sin: torch.Tensor | None = None


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()


def _positions(n: int, positions: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(n) if positions is None else positions


def _capture(base: torch.nn.Module, keep: Callable[[str], Callable], attention: Callable[[str, Any], list],
             run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`run()` with forward hooks on the modules both layouts name alike (HF names): embeddings, norms, MLPs
    and blocks get `keep(name)`; `attention(name, module)` hooks a layer's attention and returns the handles."""
    hooks = [base.embed_tokens.register_forward_hook(keep("embed")), base.norm.register_forward_hook(keep("norm"))]
    for i, layer in enumerate(base.layers):
        p = f"layers.{i}."
        hooks += attention(p + "self_attn", layer.self_attn)
        hooks += [layer.input_layernorm.register_forward_hook(keep(p + "input_layernorm")),
                  layer.post_attention_layernorm.register_forward_hook(keep(p + "post_attention_layernorm")),
                  layer.mlp.register_forward_hook(keep(p + "mlp")),
                  layer.register_forward_hook(keep(f"layers.{i}"))]
    try:
        return run()
    finally:
        for h in hooks:
            h.remove()


class Backend:
    """What the oracle needs from a model: the logits of a token sequence and, where `supports_activations`,
    its named activations. `load` builds one from a checkpoint path."""

    name = "backend"
    supports_activations = False

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "Backend":
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def vocab_size(self) -> int | None:
        return None

    def logits(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def activations(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> Activations:
        raise BackendError(f"{self.name}: no layer-by-layer activations from this backend")

    def teacher_force(self, prompt: Sequence[int], answer: Sequence[int]) -> QuestionRecord:
        """The backend's logits at each step of `answer` after `prompt`: one pass over prompt + answer[:-1];
        row P - 1 + s predicts answer token s. Its greedy token at each step is the argmax there."""
        p, steps = len(prompt), len(answer)
        logits = self.logits(list(prompt) + list(answer[:-1]))[p - 1:p - 1 + steps]  # (steps, vocab)
        return QuestionRecord(list(prompt), logits.argmax(dim=-1).tolist(), logits)


# --------------------------------------------------------------------------------------------------
# minillama


class MinillamaBackend(Backend):
    """A minillama `Llama`: the reference. `positions`, if given, replace the positions 0 .. T-1."""

    name = "minillama"
    supports_activations = True

    def __init__(self, model: Llama):
        self.model = model

    def describe(self) -> str:
        return f"minillama ({'batch-invariant' if self.model.invariant else 'plain'} kernels, {self.model.dtype})"

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def logits(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        return _cpu(self.model(torch.tensor(list(ids)), _positions(len(ids), positions)))

    def activations(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> Activations:
        model, acts, n = self.model, Activations({}), len(ids)

        # The model pads the N tokens to whole row tiles; the padding rows are not kept.
        def keep(name: str) -> Callable:
            return lambda _mod, _args, out: acts.tensors.__setitem__(name, _cpu(out[:n]))

        def attention(name: str, attn) -> list:
            p, got = name + ".", {}

            def projection(key: str) -> Callable:
                def hook(_mod, _args, out) -> None:
                    got[key] = out
                    acts.tensors[p + key] = _cpu(out[:n])
                return hook

            def after(_mod, args, out) -> None:
                # Attention.forward(x, cos, sin, ...): sin has RoPE's sign folded in (rope.signed_sin).
                cos, sin = args[1], args[2]
                rows, d = out.shape[0], attn.head_dim
                for key in ("q", "k"):
                    rotated = apply_rope_folded(got[key + "_proj"].view(rows, -1, d), cos, sin).reshape(rows, -1)
                    acts.tensors[p + key + "_rope"] = _cpu(rotated[:n])
                if acts.cos is None:
                    acts.cos, acts.sin = _cpu(cos[:n]), _cpu(signed_sin(sin)[:n])  # signed_sin undoes itself
                acts.tensors[name] = _cpu(out[:n])

            return [getattr(attn, k).register_forward_hook(projection(k)) for k in ("q_proj", "k_proj", "v_proj")] + \
                [attn.register_forward_hook(after)]

        acts.tensors["logits"] = _capture(model.model, keep, attention, lambda: self.logits(ids, positions))
        return acts


# --------------------------------------------------------------------------------------------------
# HF transformers


class TransformersBackend(Backend):
    """HF transformers' `LlamaForCausalLM` (or any model with its module names), eager attention.

    `positions`, if given, maps a sequence length T to the (T,) position ids to run with (the default is
    0 .. T-1); tests use it to build a candidate with a position bug.
    """

    name = "transformers"
    supports_activations = True

    def __init__(self, model: torch.nn.Module, source: str = "",
                 positions: Callable[[int], torch.Tensor] | None = None):
        self.model = model.eval()
        self.source = source
        self.position_fn = positions

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "TransformersBackend":
        """An HF directory, or a .gguf file read by transformers' own GGUF loader and dequantizer."""
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise BackendError("the transformers backend needs HF transformers (pip install transformers)") from None
        p = Path(path)
        kwargs = dict(attn_implementation="eager", dtype=dtype)
        if p.is_file() and p.suffix == ".gguf":
            kwargs["gguf_file"] = p.name
            p = p.parent
        elif not (p / "config.json").is_file():
            raise BackendError(f"{path}: not an HF directory (no config.json) or a .gguf file")
        # HF's progress bars and notices are not part of the report (its GGUF reader calls tqdm itself).
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
        except Exception as e:  # HF raises many types; the message names the problem
            raise BackendError(f"{path}: transformers cannot load it ({type(e).__name__}: {e})") from None
        return cls(model.to(device), str(path))

    def describe(self) -> str:
        import transformers

        via = " via gguf_file" if self.source.endswith(".gguf") else ""
        return (f"transformers {transformers.__version__} {type(self.model).__name__}{via} "
                f"({self.model.config._attn_implementation} attention, {self.model.dtype})")

    def vocab_size(self) -> int | None:
        return getattr(self.model.get_output_embeddings(), "out_features", None)  # lm_head: the logits' width

    def _run(self, ids: Sequence[int], positions: torch.Tensor | None) -> torch.Tensor:
        n = len(ids)
        if positions is None and self.position_fn is not None:
            positions = self.position_fn(n)
        device = next(self.model.parameters()).device
        # An explicit all-ones mask: with position ids that jump, HF would otherwise read the sequence
        # as several packed ones and mask between them.
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)], device=device),
                             position_ids=_positions(n, positions)[None].to(device),
                             attention_mask=torch.ones(1, n, dtype=torch.long, device=device), use_cache=False)
        return _cpu(out.logits[0])

    def logits(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(ids, positions)

    def activations(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> Activations:
        acts = Activations({})
        rotate = getattr(sys.modules[type(self.model).__module__], "apply_rotary_pos_emb", None)
        if rotate is None:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as rotate

        def first(out):
            return out[0] if isinstance(out, tuple) else out

        def keep(name: str) -> Callable:
            return lambda _mod, _args, out: acts.tensors.__setitem__(name, _cpu(first(out)[0]))

        def attention_output(p: str, attn) -> Callable:
            def hook(_mod, _args, kwargs, out) -> None:
                cos, sin = kwargs["position_embeddings"]  # (1, T, D) each
                q, k = (acts.tensors[p + "q_proj"], acts.tensors[p + "k_proj"])
                n, d = q.shape[0], attn.head_dim
                q4 = q.view(1, n, -1, d).transpose(1, 2)  # (1, H, T, D), HF's layout
                k4 = k.view(1, n, -1, d).transpose(1, 2)
                qr, kr = rotate(q4, k4, _cpu(cos), _cpu(sin))
                acts.tensors[p + "q_rope"] = qr.transpose(1, 2).reshape(n, -1)
                acts.tensors[p + "k_rope"] = kr.transpose(1, 2).reshape(n, -1)
                acts.tensors[p[:-1]] = _cpu(first(out)[0])
                if acts.cos is None:
                    acts.cos, acts.sin = _cpu(cos[0]), _cpu(sin[0])
            return hook

        def attention(name: str, attn) -> list:
            return [attn.q_proj.register_forward_hook(keep(name + ".q_proj")),
                    attn.k_proj.register_forward_hook(keep(name + ".k_proj")),
                    attn.v_proj.register_forward_hook(keep(name + ".v_proj")),
                    attn.register_forward_hook(attention_output(name + ".", attn), with_kwargs=True)]

        acts.tensors["logits"] = _capture(self.model.model, keep, attention, lambda: self._run(ids, positions))
        return acts


# --------------------------------------------------------------------------------------------------
# llama.cpp (optional)


class LlamaCppBackend(Backend):
    """llama.cpp through llama-cpp-python, in process, on a .gguf file. No activations.

    What it differs by is llama.cpp's own arithmetic: quantized weights stay quantized and the activations
    are quantized to match them in the dot products (logits move by about 1 on the default Q4_1 model); its
    KV cache is F16 by default (about 2e-2 on the logits of an F32 file); `kv_type="f32"` keeps it in F32.

    The model is loaded without llama.cpp's extra CPU buffer types (`use_extra_bufts = False`, the `-nr` /
    `--no-repack` of its command-line tools): on CPUs with AMX, llama.cpp's AMX matrix code crashes on Q4_1
    (a segfault inside `llama_decode`). Without them it runs on every CPU, with the plain CPU kernels.
    llama-cpp-python's `Llama(...)` has no argument for it, so its model defaults are amended while it loads.
    """

    name = "llama.cpp"

    def __init__(self, path: str | Path, n_ctx: int = 4096, kv_type: str | None = None):
        try:
            import llama_cpp
            from llama_cpp import Llama as _LlamaCpp
        except ImportError:
            raise BackendError("the llama-cpp backend needs llama-cpp-python (pip install llama-cpp-python)") from None
        if not (Path(path).is_file() and str(path).endswith(".gguf")):
            raise BackendError(f"{path}: the llama-cpp backend needs a .gguf file")
        self.source, self.kv_type = str(path), kv_type
        kwargs: dict[str, Any] = dict(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False)
        if kv_type is not None:
            types = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
            kwargs["type_k"] = kwargs["type_v"] = types[kv_type]
        low = getattr(llama_cpp, "llama_cpp", None)  # the ctypes module Llama reads its defaults from
        defaults = getattr(low, "llama_model_default_params", None)

        def without_extra_buffer_types():
            params = defaults()
            params.use_extra_bufts = False
            return params

        if defaults is not None:
            low.llama_model_default_params = without_extra_buffer_types
        try:
            self.llm = _LlamaCpp(**kwargs)
        except (ValueError, RuntimeError) as e:
            raise BackendError(f"{path}: llama.cpp cannot load it ({e})") from None
        finally:
            if defaults is not None:
                low.llama_model_default_params = defaults

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> "LlamaCppBackend":
        return cls(path)  # llama.cpp picks its own device and types

    def describe(self) -> str:
        import llama_cpp

        kv = self.kv_type or "default (F16)"
        return (f"llama.cpp (llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {Path(self.source).name}, "
                f"KV cache {kv}, extra CPU buffer types off)")

    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def logits(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:
            raise BackendError("llama.cpp backend: only positions 0 .. T-1 are supported")
        self.llm.reset()
        self.llm.eval(list(ids))
        return torch.tensor(self.llm.scores[: len(ids)], dtype=torch.float32)


BACKENDS: dict[str, type[Backend]] = {"transformers": TransformersBackend, "llama-cpp": LlamaCppBackend}
# "openai" (any OpenAI-compatible server) is added by server.py, which needs a URL rather than a checkpoint.


def load_backend(kind: str, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Backend:
    if kind not in BACKENDS:
        raise BackendError(f"unknown backend {kind!r} (choose from {', '.join(BACKENDS)})")
    return BACKENDS[kind].load(path, device, dtype)

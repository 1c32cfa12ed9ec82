"""A GGUF file's tokenizer: its `tokenizer.ggml.*` metadata (the vocabulary, its token types, scores or merges,
BOS/EOS and how they are added, the chat template) read and checked, then built as the sentencepiece or
byte-level BPE tokenizer llama.cpp builds from it.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .base import NORMAL, Tokenizer, TokenizerError, check_template
from .bpe import BOS_BY_DEFAULT, HFTokenizer, _unique, byte_bpe_tokenizer
from .spm import SentencePieceTokenizer, sentencepiece_proto


def tokenizer_from_gguf_metadata(meta: dict[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF file describes. `meta` maps keys (`tokenizer.ggml.tokens`, ...) to values."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or meta.get("tokenizer.ggml.tokens") is None:
        raise TokenizerError(f"{source}: no tokenizer in the metadata (tokenizer.ggml.model/tokens missing)")
    _check_gguf_types(meta, source)  # each field's type, before any is used
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    for key, values in (("token_type", types), ("scores", meta.get("tokenizer.ggml.scores"))):
        if values is not None and len(values) != len(tokens):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")
    for key in ("bos", "eos", "eot", "eom"):  # an id past the token list names no token: refused, named
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not (_is_id(i) and i < len(tokens)):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key}_token_id {i!r} is not a token id (the "
                                 f"{len(tokens)} tokens have ids 0 to {len(tokens) - 1})")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None and kind == "llama" and len(tokens) > 2:  # llama.cpp's EOS where a sentencepiece vocabulary
        eos = 2  # names none: sentencepiece's own, as its BOS is 1 (the model's, in SentencePieceTokenizer)
    eos_ids = _unique([int(i) for i in (eos, meta.get("tokenizer.ggml.eot_token_id"),
                                        meta.get("tokenizer.ggml.eom_token_id")) if i is not None])
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        check_template(template, f"{source}, field tokenizer.chat_template")
    tok = _gguf_tokenizer(meta, source, kind, tokens, types, bos_id, eos_ids, template)
    tok.source, tok.template_source = source, f"{source}, field tokenizer.chat_template"
    return tok


def _gguf_tokenizer(meta: dict[str, Any], source: str, kind: Any, tokens: list, types: list, bos_id: Any,
                    eos_ids: list[int], template: str | None) -> Tokenizer:
    if kind == "llama":
        proto = sentencepiece_proto(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                    add_dummy_prefix=_flag(meta, "add_space_prefix", True, source))
        try:
            return SentencePieceTokenizer(proto, bos_id=bos_id, eos_ids=eos_ids, chat_template=template,
                                          add_bos=_flag(meta, "add_bos_token", True, source),
                                          add_eos=_flag(meta, "add_eos_token", False, source))
        except TokenizerError as e:
            raise TokenizerError(f"{source}: {e}") from None
    if kind == "gpt2":
        if "tokenizer.ggml.pre" not in meta:  # older files: llama.cpp then splits its own "default" way
            raise TokenizerError(f"{source}: tokenizer.ggml.pre missing: which pre-tokenizer splits the text is not "
                                 "said (llama.cpp guesses 'default'); convert the model again with a current llama.cpp")
        if "tokenizer.ggml.merges" not in meta:  # without them every text would split byte by byte
            raise TokenizerError(f"{source}: tokenizer.ggml.merges missing: a gpt2 (byte-level BPE) tokenizer "
                                 "needs its merges")
        add_bos = _flag(meta, "add_bos_token", meta["tokenizer.ggml.pre"] in BOS_BY_DEFAULT, source)
        add_eos = _flag(meta, "add_eos_token", False, source)
        try:
            tok = byte_bpe_tokenizer(tokens, meta.get("tokenizer.ggml.merges") or [], types,
                                     meta["tokenizer.ggml.pre"], bos_id=bos_id, add_bos=add_bos,
                                     eos_id=meta.get("tokenizer.ggml.eos_token_id"), add_eos=add_eos)
        except TokenizerError as e:
            raise TokenizerError(f"{source}: {e}") from None
        return HFTokenizer(tok, bos_token=tokens[bos_id] if bos_id is not None else None,
                           extra_eos_ids=eos_ids, chat_template=template, add_bos=add_bos, add_eos=add_eos)
    raise TokenizerError(f"{source}: unsupported tokenizer type {kind!r} (supported: llama, gpt2)")


MAX_TOKEN_TYPE = 6  # GGUF token types: undefined, normal, unknown, control, user-defined, unused, byte

# What each item of a `tokenizer.ggml.*` list must be (a test, and its words for the message): a string, a
# number, or a wrong token type would be a TypeError deep in the library, or leave a special token plain text.
GGUF_LISTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tokens": (lambda x: isinstance(x, str), "a string"),
    "token_type": (lambda x: _is_id(x) and x <= MAX_TOKEN_TYPE, f"a token type (0 to {MAX_TOKEN_TYPE})"),
    "scores": (lambda x: isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)), "a number"),
    "merges": (lambda x: isinstance(x, str), 'a string ("a b")'),
}


def _check_gguf_types(meta: dict[str, Any], source: str) -> None:
    """Each `tokenizer.ggml.*` list a list of what GGUF_LISTS says ("abc" is no list of three tokens), `pre` a
    string; TokenizerError naming the field otherwise."""
    for key, (ok, what) in GGUF_LISTS.items():
        values = meta.get(f"tokenizer.ggml.{key}")
        if values is None:
            continue
        if not isinstance(values, (list, tuple)):
            raise TokenizerError(f"{source}: tokenizer.ggml.{key} must be a list, got {repr(values)[:80]}")
        bad = next((x for x in values if not ok(x)), ok)  # `ok` itself: no item is bad
        if bad is not ok:
            raise TokenizerError(f"{source}: tokenizer.ggml.{key} holds {repr(bad)[:80]}, not {what}")
    pre = meta.get("tokenizer.ggml.pre")
    if not (pre is None or isinstance(pre, str)):
        raise TokenizerError(f"{source}: tokenizer.ggml.pre must be a string, got {repr(pre)[:80]}")


def _flag(meta: dict[str, Any], key: str, default: bool, source: str) -> bool:
    """A boolean field of `tokenizer.ggml.*`; TokenizerError for any other type ("false" is no False)."""
    value = meta.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, (bool, np.bool_)):
        raise TokenizerError(f"{source}: tokenizer.ggml.{key} must be a boolean, got {value!r}")
    return bool(value)


def read_gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from None
    return gguf_values(reader, str(path), "tokenizer.")


def gguf_values(reader: Any, source: str, prefix: str = "") -> dict[str, Any]:
    """The metadata of a `gguf.GGUFReader` whose keys start with `prefix`, key -> value. gguf-py decodes
    strings as strict UTF-8 when asked for them: a string that is not is TokenizerError naming the key."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith(prefix):
            continue
        try:
            out[key] = field.contents()
        except UnicodeDecodeError:
            parts = [bytes(field.parts[i]) for i in field.data]  # one string, or each string of an array
            k, bad = next((k, b) for k, b in enumerate(parts) if not _utf8(b))
            where = f" (string {k}: {bad[:40]!r})" if len(parts) > 1 else f" ({bad[:40]!r})"
            raise TokenizerError(f"{source}: field {key} is not valid UTF-8{where}") from None
    return out


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0

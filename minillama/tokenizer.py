"""One tokenizer interface over the two kinds Llama checkpoints ship, and their chat templates.

- `SentencePieceTokenizer`: a sentencepiece model (`tokenizer.model`, Llama 1/2 family), or one rebuilt
  from a GGUF `llama` vocabulary (pieces, scores and types are sentencepiece's own, so the rebuilt model
  tokenizes exactly as sentencepiece does).
- `HFTokenizer`: the `tokenizers` library, from a `tokenizer.json` or built from a GGUF `gpt2`
  (byte-level BPE) vocabulary and merges, the way llama.cpp splits text for that vocabulary.

Control tokens written in text ("<|im_start|>" in a rendered chat prompt) become their ids in both,
unless `parse_special=False`. Chat templates are the checkpoint's own Jinja source, rendered the way HF
transformers renders them (`apply_chat_template`: a sandboxed environment with `raise_exception`,
`strftime_now` and `tojson`). `encode_chat` tokenizes a rendered chat so that only the template's own
markers are control tokens: "<|im_end|>" written in a document is text, it cannot close a turn.
"""

from __future__ import annotations

import json
import re
import struct
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from .errors import OneLineError
from .files import write_file


class TokenizerError(OneLineError):
    """A tokenizer file that is missing, unreadable or of a kind minillama does not support."""


# GGUF `tokenizer.ggml.token_type` values; they are sentencepiece's `ModelProto.SentencePiece.Type`.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class Tokenizer:
    """What the rest of minillama needs from a tokenizer. Build one with `load_tokenizer(path)`."""

    bos_id: int | None
    eos_ids: list[int]  # every id that ends generation (EOS, end-of-turn, ...)
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool | None  # what encode(text, add_special=True) adds
    add_eos: bool | None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. Control tokens written in the text become their ids, or with
        `parse_special=False` are spelled out as text like any other characters. `add_special` adds what
        the checkpoint adds around a sequence (BOS for Llama 1/2; nothing for SmolLM2)."""
        raise NotImplementedError

    def special_tokens(self) -> list[str]:
        """The text of every control token `encode` turns into its id."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:
        raise NotImplementedError

    def save(self, out_dir: str | Path) -> None:
        """Write the tokenizer files of an HF directory (tokenizer.json or tokenizer.model, and
        tokenizer_config.json with the chat template and special tokens)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]). Encode it with
        `encode(text)`: templates write BOS themselves where the model wants it."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """Token ids of the rendered chat (`apply_chat_template`), with the messages' text kept as text:
        a control token written in a message ("<|im_end|>\n<|im_start|>system" in a document) is spelled
        out and cannot end a turn or open a new one; only the template's own markers are control tokens.
        Without such text in the messages this is `encode(apply_chat_template(...))`, token for token."""
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        specials = self.special_tokens()
        if not any(isinstance(m.get("content"), str) and any(t in m["content"] for t in specials)
                   for m in messages):
            return self.encode(text)
        spans = self._message_spans(messages, text, add_generation_prompt, variables)
        # Runs of text between the template's markers are encoded whole (message text and template
        # text together, as `encode` would), with control-token parsing off inside them.
        pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
        ids: list[int] = []
        run_start, pos = 0, 0
        for lo, hi in [*spans, (len(text), len(text))]:
            for m in pattern.finditer(text, pos, lo):  # markers in the template text before this message
                ids += self.encode(text[run_start:m.start()], parse_special=False) if m.start() > run_start else []
                ids += self.encode(m.group(0))
                run_start = m.end()
            pos = hi
        if run_start < len(text):
            ids += self.encode(text[run_start:], parse_special=False)
        return ids

    def _message_spans(self, messages: list[dict[str, Any]], text: str, add_generation_prompt: bool,
                       variables: dict[str, Any]) -> list[tuple[int, int]]:
        """Where each message's text lies in the rendered chat `text`, in order. The template is rendered
        a second time with a placeholder for each message's text; the pieces of template between the
        placeholders are matched against `text`, each message's text taken as it is or trimmed (what
        templates do with it)."""
        marks = [f"\ue000{k}\ue001" for k in range(len(messages))]
        skeleton = self.apply_chat_template(
            [{**m, "content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)],
            add_generation_prompt, **variables)
        pieces = re.split("\ue000(\\d+)\ue001", skeleton)  # template, message index, template, ...
        spans: list[tuple[int, int]] = []
        pos = len(pieces[0])
        if not text.startswith(pieces[0]):
            raise TokenizerError("the chat template renders the messages in a way that cannot be matched "
                                 "back to their text; message text with control tokens cannot be kept as text")
        for k, after in zip(pieces[1::2], pieces[2::2]):
            content = messages[int(k)]["content"]
            for v in dict.fromkeys((content, content.strip())):
                if text.startswith(v, pos) and text.startswith(after, pos + len(v)):
                    spans.append((pos, pos + len(v)))
                    pos += len(v) + len(after)
                    break
            else:
                raise TokenizerError("the chat template changes the message text; message text with control "
                                     "tokens cannot be kept as text")
        return spans

    def _config_json(self) -> dict[str, Any]:
        """tokenizer_config.json, in the keys HF transformers reads."""
        return {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
            # Every end-of-generation id (EOS, end-of-turn, ...); HF reads eos_token only.
            "eos_token_ids": self.eos_ids,
        }

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, chat_template={'yes' if self.chat_template else 'no'})")


# --------------------------------------------------------------------------------------------------
# sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model. Text is split on control tokens first (sentencepiece itself would spell
    "<s>" as pieces), and each piece of text between them is encoded on its own, which is how HF's
    Llama tokenizers treat special tokens in text."""

    def __init__(self, model_proto: bytes, *, bos_id: int | None = None, eos_ids: Sequence[int] | None = None,
                 add_bos: bool = True, add_eos: bool = False, chat_template: str | None = None) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError / OSError with its own text
            raise TokenizerError(f"not a sentencepiece model ({e})") from None
        self._proto = model_proto
        n = self._sp.get_piece_size()
        self.bos_id = bos_id if bos_id is not None else _none_if_negative(self._sp.bos_id())
        self.eos_ids = list(eos_ids) if eos_ids is not None else [i for i in [self._sp.eos_id()] if i >= 0]
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.bos_token = self._sp.id_to_piece(self.bos_id) if self.bos_id is not None else None
        self.eos_token = self._sp.id_to_piece(self.eos_ids[0]) if self.eos_ids else None
        self._special = {self._sp.id_to_piece(i): i for i in range(n)
                         if self._sp.is_control(i) or self._sp.is_unknown(i)}
        # Longest first, so that a control token that is a prefix of another does not win.
        names = sorted(self._special, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "SentencePieceTokenizer":
        data = Path(path).read_bytes()
        if _looks_like_tiktoken(data):
            raise TokenizerError(f"{path}: a tiktoken BPE file (Llama 3 style), not a sentencepiece model; "
                                 "convert the checkpoint to an HF directory with a tokenizer.json")
        try:
            return cls(data, **kwargs)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text) if self._split and parse_special else [text]
        for k, part in enumerate(parts):
            if k % 2:  # odd parts are the control tokens the split captured
                ids.append(self._special[part])
            elif part:
                ids.extend(self._sp.encode(part, out_type=int))
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_ids:
                ids.append(self.eos_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in map(int, ids):
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                out.append(self._sp.decode(run))
                run = []
                if not skip_special:
                    out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)

    def special_tokens(self) -> list[str]:
        return list(self._special)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        write_file(out / "tokenizer.model", self._proto)
        cfg = {"tokenizer_class": "LlamaTokenizer", "legacy": True, **self._config_json()}
        write_file(out / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _none_if_negative(i: int) -> int | None:
    return i if i >= 0 else None


def _looks_like_tiktoken(data: bytes) -> bool:
    # tiktoken files are lines "<base64 token> <rank>"; a sentencepiece model is a binary protobuf.
    head = data[:200].split(b"\n")[0].split(b" ")
    return len(head) == 2 and head[1].isdigit() and re.fullmatch(rb"[A-Za-z0-9+/=]+", head[0]) is not None


def _pb_varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # protobuf writes negative int32 as 10-byte two's complement
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb(field: int, value: int | float | bytes | str) -> bytes:
    """One protobuf field: bool/int as varint, float as fixed32, str/bytes length-delimited."""
    if isinstance(value, float):
        return _pb_varint(field << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, (bool, int)):
        return _pb_varint(field << 3) + _pb_varint(int(value))
    data = value.encode() if isinstance(value, str) else value
    return _pb_varint(field << 3 | 2) + _pb_varint(len(data)) + data


def sentencepiece_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                        add_dummy_prefix: bool = True) -> bytes:
    """A serialized sentencepiece BPE `ModelProto` with these pieces (field numbers from
    sentencepiece_model.proto). Normalization is "identity" and whitespace is kept as it is, as in
    Llama's own tokenizer.model; the GGUF `llama` vocabulary is such a model, written out."""
    pieces = b"".join(_pb(1, _pb(1, t) + _pb(2, float(s)) + _pb(3, int(k)))
                      for t, s, k in zip(tokens, scores, types))
    # TrainerSpec: model_type=3 (BPE=2), vocab_size=4, byte_fallback=35.
    trainer = _pb(3, 2) + _pb(4, len(tokens)) + _pb(35, BYTE in set(types))
    # NormalizerSpec: name=1, add_dummy_prefix=3, remove_extra_whitespaces=4, escape_whitespaces=5.
    normalizer = _pb(1, "identity") + _pb(3, add_dummy_prefix) + _pb(4, False) + _pb(5, True)
    return pieces + _pb(2, trainer) + _pb(3, normalizer)


# --------------------------------------------------------------------------------------------------
# tokenizers (tokenizer.json, byte-level BPE)


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json). Its added special tokens are matched in text by the
    library; `add_special` runs the file's own post-processor (e.g. Llama 3 adds BOS there)."""

    def __init__(self, tok: Any, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 extra_eos_ids: Sequence[int] = (), chat_template: str | None = None,
                 add_bos: bool | None = None, add_eos: bool | None = None) -> None:
        self._tok = tok
        self.bos_token = bos_token
        self.bos_id = tok.token_to_id(bos_token) if bos_token is not None else None
        self.eos_ids = _unique([tok.token_to_id(t) for t in eos_tokens if tok.token_to_id(t) is not None]
                               + [int(i) for i in extra_eos_ids])
        self.eos_token = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        self.chat_template = chat_template
        self.add_bos, self.add_eos = add_bos, add_eos

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
        return cls(tok, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        if parse_special:
            ids = self._tok.encode(text, add_special_tokens=add_special).ids
        else:  # the library's switch that spells special tokens out as text
            saved, self._tok.encode_special_tokens = self._tok.encode_special_tokens, True
            try:
                ids = self._tok.encode(text, add_special_tokens=add_special).ids
            finally:
                self._tok.encode_special_tokens = saved
        if add_special and self._tok.post_processor is None:  # then tokenizer_config.json decides
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_ids:
                ids.append(self.eos_ids[0])
        return ids

    def special_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        write_file(out / "tokenizer.json", self._tok.to_str(pretty=True))  # what `save` writes
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **self._config_json()}
        if cfg["add_bos_token"] is None:
            del cfg["add_bos_token"], cfg["add_eos_token"]  # the post-processor in tokenizer.json decides
        write_file(out / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _unique(ids: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(ids))


# How llama.cpp splits text before byte-level BPE, by GGUF `tokenizer.ggml.pre` (llama-vocab.cpp):
# (regex for a Split pre-tokenizer or None for GPT-2's own, digits one by one?, ignore_merges?).
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BPE_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "gpt-2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "refact": (_GPT2_SPLIT, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
}


def byte_bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str,
                       *, bos_id: int | None, add_bos: bool) -> Any:
    """A `tokenizers.Tokenizer` for a GGUF `gpt2` vocabulary: BPE over byte-level symbols, text split
    as llama.cpp splits it for this `pre` type, control tokens matched whole as special tokens."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _Tok

    if pre not in BPE_PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r} (supported: {', '.join(BPE_PRE_TOKENIZERS)})")
    split, single_digits, ignore_merges = BPE_PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = _Tok(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if single_digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tok


# --------------------------------------------------------------------------------------------------
# loading


def tokenizer_from_gguf_metadata(meta: dict[str, Any], source: str = "GGUF file") -> Tokenizer:
    """The tokenizer a GGUF file describes. `meta` maps keys (`tokenizer.ggml.tokens`, ...) to values."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{source}: no tokenizer in the metadata (tokenizer.ggml.model/tokens missing)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = _unique([int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                "tokenizer.ggml.eom_token_id") if meta.get(k) is not None])
    template = meta.get("tokenizer.chat_template")
    if kind == "llama":
        proto = sentencepiece_proto(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                    add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        try:
            return SentencePieceTokenizer(proto, bos_id=bos_id, eos_ids=eos_ids, chat_template=template,
                                          add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
                                          add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
        except TokenizerError as e:
            raise TokenizerError(f"{source}: {e}") from None
    if kind == "gpt2":
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        try:
            tok = byte_bpe_tokenizer(tokens, meta.get("tokenizer.ggml.merges") or [], types,
                                     meta.get("tokenizer.ggml.pre", "default"), bos_id=bos_id, add_bos=add_bos)
        except TokenizerError as e:
            raise TokenizerError(f"{source}: {e}") from None
        return HFTokenizer(tok, bos_token=tokens[bos_id] if bos_id is not None else None,
                           extra_eos_ids=eos_ids, chat_template=template, add_bos=add_bos,
                           add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    raise TokenizerError(f"{source}: unsupported tokenizer type {kind!r} (supported: llama, gpt2)")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF or Meta directory, a .gguf file, a tokenizer.json or a
    sentencepiece tokenizer.model."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return tokenizer_from_gguf_metadata(read_gguf_tokenizer_metadata(p), str(p))
    if p.is_file() and p.name.endswith(".json"):
        return HFTokenizer.from_file(p)
    if p.is_file():
        return SentencePieceTokenizer.from_file(p)
    if not p.is_dir():
        raise TokenizerError(f"{p}: no such file or directory")
    cfg = _read_json(p / "tokenizer_config.json") if (p / "tokenizer_config.json").exists() else {}
    template = _chat_template(p, cfg)
    eos_ids = _eos_ids_from_configs(p)
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if (p / "tokenizer.json").exists():
        return HFTokenizer.from_file(
            p / "tokenizer.json", bos_token=bos, eos_tokens=[eos] if eos else [],
            extra_eos_ids=list(cfg.get("eos_token_ids") or []) + eos_ids, chat_template=template,
            add_bos=cfg.get("add_bos_token"), add_eos=cfg.get("add_eos_token"))
    if (p / "tokenizer.model").exists():
        tok = SentencePieceTokenizer.from_file(p / "tokenizer.model", add_bos=cfg.get("add_bos_token", True),
                                               add_eos=cfg.get("add_eos_token", False), chat_template=template)
        if bos is not None and tok.token_to_id(bos) is not None:
            tok.bos_id, tok.bos_token = tok.token_to_id(bos), bos
        extra = [tok.token_to_id(eos)] if eos is not None and tok.token_to_id(eos) is not None else []
        tok.eos_ids = _unique(extra + tok.eos_ids + list(cfg.get("eos_token_ids") or []) + eos_ids)
        return tok
    raise TokenizerError(f"{p}: no tokenizer (looked for tokenizer.json and tokenizer.model)")


def read_gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({e})") from None
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: must be a JSON object, got a {type(d).__name__}")
    return d


def _token_text(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return tok.get("content") if isinstance(tok, dict) else tok


def _chat_template(d: Path, cfg: dict[str, Any]) -> str | None:
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        t = {x.get("name"): x.get("template") for x in t}.get("default")
    if t is None and (d / "chat_template.jinja").exists():
        t = (d / "chat_template.jinja").read_text()
    if t is None and (d / "chat_template.json").exists():
        t = _read_json(d / "chat_template.json").get("chat_template")
    return t


def _eos_ids_from_configs(d: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (d / name).exists():
            e = _read_json(d / name).get("eos_token_id")
            ids += [] if e is None else list(e) if isinstance(e, list) else [e]
    return _unique(ids)


def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; HF's does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)

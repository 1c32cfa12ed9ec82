"""Sentencepiece tokenizers: a `tokenizer.model` (Llama 1/2 family), or one rebuilt from a GGUF `llama`
vocabulary (`sentencepiece_proto`: pieces, scores and types are sentencepiece's own, so the rebuilt model
tokenizes exactly as sentencepiece does).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Sequence

from ..files import write_file
from .base import BYTE, CONTROL, NORMAL, USER_DEFINED, Tokenizer, TokenizerError
from .bpe import llama_class_decoder


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model. Text is split on control tokens first (sentencepiece itself would spell
    "<s>" as pieces), and each piece of text between them is encoded on its own, which is how HF's
    Llama tokenizers treat special tokens in text. Each piece gets sentencepiece's own "▁" before it (its dummy
    prefix), as llama.cpp puts a space after every special token; or, with a `prepend_scheme`, the rule of HF's
    LlamaTokenizer class: "▁" before a piece that does not start with a space, before every piece ("always"),
    the first of the whole text only ("first") or none ("never"), and HF's decoder."""

    def __init__(self, model_proto: bytes, *, bos_id: int | None = None, eos_ids: Sequence[int] | None = None,
                 add_bos: bool = True, add_eos: bool = False, chat_template: str | None = None,
                 added: dict[int, tuple[str, bool]] | None = None, prepend_scheme: str | None = None) -> None:
        """`added`: tokens an HF directory adds to the model (id -> (text, special)), from tokenizer_config.json's
        added_tokens_decoder or added_tokens.json; they become pieces of the model (`with_added_pieces`)."""
        self._sp = self._load(model_proto)
        if added:
            model_proto = with_added_pieces(self._sp, model_proto, added)
            self._sp = self._load(model_proto)
        self._proto, self.prepend_scheme = model_proto, prepend_scheme
        if prepend_scheme is not None:
            self._bare = self._load(model_proto + _pb(3, _pb(3, False)))  # no dummy prefix (a normalizer_spec
            self._decoder = llama_class_decoder(prepend_scheme)  # written again merges into the first)
        n = self._sp.get_piece_size()
        self.bos_id = bos_id if bos_id is not None else _none_if_negative(self._sp.bos_id())
        self.eos_ids = list(eos_ids) if eos_ids is not None else [i for i in [self._sp.eos_id()] if i >= 0]
        for what, i in [("BOS", self.bos_id)] + [("EOS", e) for e in self.eos_ids]:
            if i is not None and not 0 <= i < n:
                raise TokenizerError(f"{what} id {i} is not a piece of the model (ids 0 to {n - 1})")
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self.bos_token = self._sp.id_to_piece(self.bos_id) if self.bos_id is not None else None
        self.eos_token = self._sp.id_to_piece(self.eos_ids[0]) if self.eos_ids else None
        self._special = {self._sp.id_to_piece(i): i for i in range(n)
                         if self._sp.is_control(i) or self._sp.is_unknown(i)}
        # HF's class makes user-defined pieces added tokens, not special ones: they split the text too, in any text
        types = piece_types(model_proto) if prepend_scheme is not None else []
        user = [self._sp.id_to_piece(i) for i, kind in enumerate(types) if kind == USER_DEFINED]
        self._split, self._split_literal = _pattern([*self._special, *user]), _pattern(user)

    @staticmethod
    def _load(model_proto: bytes) -> Any:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError / OSError with its own text
            raise TokenizerError(f"not a sentencepiece model ({e})") from None
        return sp

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "SentencePieceTokenizer":
        data = Path(path).read_bytes()
        if _looks_like_tiktoken(data):
            raise TokenizerError(f"{path}: a tiktoken BPE file (Llama 3 style), not a sentencepiece model; "
                                 "convert the checkpoint to an HF directory with a tokenizer.json")
        try:
            tok = cls(data, **kwargs)
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None
        tok.source = str(path)
        return tok

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True,
               continues: bool = False) -> list[int]:
        ids: list[int] = []
        split = self._split if parse_special and not self.split_special else self._split_literal
        for k, part in enumerate(split.split(text) if split else [text]):
            if k % 2:  # odd parts are the tokens the split captured
                ids.append(self._sp.piece_to_id(part))
            elif part:
                ids.extend(self._encode_text(part, first=k == 0 and not continues))
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_ids:
                ids.append(self.eos_ids[0])
        return ids

    def _encode_text(self, text: str, first: bool) -> list[int]:
        """A text between control tokens; `first`: at the start of the whole text."""
        if self.prepend_scheme is None:
            return self._sp.encode(text, out_type=int)
        prefix = self.prepend_scheme == "always" or (self.prepend_scheme == "first" and first)
        return self._bare.encode(" " + text if prefix and not text.startswith(" ") else text, out_type=int)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if self.prepend_scheme is not None:  # as HF's class decodes: every piece, control ones too, through it
            n = self._sp.get_piece_size()
            return self._decoder.decode([self._sp.id_to_piece(i) for i in map(int, ids) if 0 <= i < n and not (
                skip_special and (self._sp.is_control(i) or self._sp.is_unknown(i)))])
        out: list[str] = []
        run: list[int] = []
        pieces = self._sp.get_piece_size()
        for i in map(int, ids):
            if not 0 <= i < pieces:  # an id of the model's vocabulary past the pieces (padding): no text, as in HF's
                continue
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

    def largest_ids(self) -> list[tuple[str, int, str]]:
        n = self._sp.get_piece_size()
        return [("pieces", n - 1, self._sp.id_to_piece(n - 1))] if n else []

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._sp.get_piece_size() else None

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        write_file(out / "tokenizer.model", self._proto)
        scheme = {"first": {"legacy": False}, "never": {"add_prefix_space": False}}.get(self.prepend_scheme or "",
                                                                                         {"legacy": True})
        cfg = {"tokenizer_class": "LlamaTokenizer", **scheme, **self._config_json()}
        write_file(out / "tokenizer_config.json", json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def with_added_pieces(sp: Any, model_proto: bytes, added: dict[int, tuple[str, bool]]) -> bytes:
    """The model with HF's added tokens as pieces of its own, so that it tokenizes as HF's tokenizer does: a
    special one as a control piece (a marker only the template writes: `encode` splits text at it), another as
    a user-defined one (sentencepiece matches it in any text). An id already a piece must be that piece; the
    new ones follow the model's last piece, in order (a piece list has no gaps). TokenizerError otherwise."""
    n = sp.get_piece_size()
    for i, (text, _) in sorted(added.items()):
        if i < n and sp.id_to_piece(i) != text:
            raise TokenizerError(f"added token {i} {text!r}: id {i} is the model's piece {sp.id_to_piece(i)!r}")
    new = sorted(i for i in added if i >= n)
    if new != list(range(n, n + len(new))):
        raise TokenizerError(f"added tokens {new[:4]}...: the model has {n} pieces, so added ones must number "
                             f"{n}, {n + 1}, ... without gaps")
    taken = [added[i][0] for i in new if sp.piece_to_id(added[i][0]) != sp.unk_id()]
    if taken:
        raise TokenizerError(f"added token {taken[0]!r} is already a piece of the model, with another id")
    return model_proto + b"".join(_pb(1, _pb(1, added[i][0]) + _pb(2, 0.0) + _pb(3, CONTROL if added[i][1] else
                                                                               USER_DEFINED)) for i in new)


def _pattern(pieces: Sequence[str]) -> re.Pattern | None:
    """The pieces as one capturing pattern, longest first (one that is a prefix of another does not win)."""
    names = sorted(pieces, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None


def _none_if_negative(i: int) -> int | None:
    return i if i >= 0 else None


def _looks_like_tiktoken(data: bytes) -> bool:
    # tiktoken files are lines "<base64 token> <rank>"; a sentencepiece model is a binary protobuf.
    head = data[:200].split(b"\n")[0].split(b" ")
    return len(head) == 2 and head[1].isdigit() and re.fullmatch(rb"[A-Za-z0-9+/=]+", head[0]) is not None


def piece_types(model_proto: bytes) -> list[int]:
    """Each piece's type (NORMAL, CONTROL, USER_DEFINED, ...), read from the serialized `ModelProto` (its field 1,
    one `SentencePiece` each, whose field 3 is the type): the sentencepiece library tells user-defined pieces from
    normal ones only there."""
    types = []
    for field, value in _pb_fields(model_proto):
        if field == 1:
            types.append(next((v for f, v in _pb_fields(value) if f == 3), NORMAL))
    return types


def _pb_fields(data: bytes) -> list[tuple[int, Any]]:
    """The top-level (field number, value) pairs of a protobuf message: varints as ints, length-delimited
    fields as bytes, fixed-width ones as their bytes."""
    out, pos = [], 0

    def varint() -> int:
        nonlocal pos
        n, shift = 0, 0
        while True:
            b = data[pos]
            pos, n, shift = pos + 1, n | (b & 0x7F) << shift, shift + 7
            if not b & 0x80:
                return n

    while pos < len(data):
        key = varint()
        wire = key & 7
        if wire == 0:
            out.append((key >> 3, varint()))
        elif wire == 2:
            size = varint()
            out.append((key >> 3, data[pos:pos + size]))
            pos += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            out.append((key >> 3, data[pos:pos + size]))
            pos += size
        else:
            raise TokenizerError(f"not a sentencepiece model (protobuf wire type {wire})")
    return out


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

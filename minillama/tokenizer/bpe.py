"""Tokenizers of the `tokenizers` library: a `tokenizer.json`, or byte-level BPE built from a GGUF `gpt2`
vocabulary and merges, with text split the way llama.cpp splits it for that vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..files import utf8_name, write_file
from .base import CONTROL, USER_DEFINED, Tokenizer, TokenizerError


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json). Its added special tokens are matched in text by the
    library; `add_special` runs the file's own post-processor (e.g. Llama 3 adds BOS there)."""

    def __init__(self, tok: Any, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 extra_eos_ids: Sequence[int] = (), chat_template: str | None = None,
                 add_bos: bool | None = None, add_eos: bool | None = None) -> None:
        self._tok, self._variants = tok, {}
        self.bos_token = bos_token
        self.bos_id = tok.token_to_id(bos_token) if bos_token is not None else None
        self.eos_ids = _unique([tok.token_to_id(t) for t in eos_tokens if tok.token_to_id(t) is not None]
                               + [int(i) for i in extra_eos_ids])
        self.eos_token = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        self.chat_template = chat_template
        self.add_bos, self.add_eos = add_bos, add_eos

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "HFTokenizer":
        out = cls(read_tokenizer_json(path), **kwargs)
        out.source = str(path)
        return out

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True,
               continues: bool = False) -> list[int]:
        tok = self._variant(parse_special and not self.split_special, continues and self._prefixes_first_only())
        # a batch of one: the library's `encode` holds the GIL throughout (a megabyte's tokenizing stalled a
        # server's other threads 1.7 s), `encode_batch` lets go of it while it works; same ids
        ids = tok.encode_batch([text], add_special_tokens=add_special)[0].ids
        if add_special and self._tok.post_processor is None:  # then tokenizer_config.json decides
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_ids:
                ids.append(self.eos_ids[0])
        return ids

    def _variant(self, parse_special: bool, continues: bool) -> Any:
        """The tokenizer, or a copy of it with the library's switch that spells special tokens out as text
        (`parse_special` false), and with no "▁" put before the text (`continues`: a text after a control token,
        where a Metaspace "first" puts none). A copy, not the switch flipped around a call: threads share the
        tokenizer (the server tokenizes requests in several at once), and a flip seen by another thread's encode
        changed how its text was split."""
        if parse_special and not continues:
            return self._tok
        key = (parse_special, continues)
        if key not in self._variants:
            from tokenizers import Tokenizer as _Tok
            from tokenizers import pre_tokenizers

            copy = _Tok.from_str(self._tok.to_str())
            copy.encode_special_tokens = not parse_special
            if continues:
                pre = copy.pre_tokenizer
                copy.pre_tokenizer = pre_tokenizers.Metaspace(replacement=pre.replacement, prepend_scheme="never",
                                                              split=pre.split)
            self._variants[key] = copy  # two threads may both build one: the same tokenizer either way
        return self._variants[key]

    def _prefixes_first_only(self) -> bool:
        """Whether the pre-tokenizer is a Metaspace that puts "▁" before the start of a whole text only."""
        return getattr(self._tok.pre_tokenizer, "prepend_scheme", None) == "first"

    def largest_ids(self) -> list[tuple[str, int, str]]:
        added = self._tok.get_added_tokens_decoder()
        vocab = {i: t for t, i in self._tok.get_vocab(with_added_tokens=False).items()}
        return [(field, max(ids), ids[max(ids)] if field == "model.vocab" else ids[max(ids)].content)
                for field, ids in (("model.vocab", vocab), ("added_tokens", added)) if ids]

    def special_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def normalized(self, text: str) -> str:
        return text if self._tok.normalizer is None else self._tok.normalizer.normalize_str(text)

    def strips(self, token: str) -> tuple[bool, bool]:
        added = {t.content: t for t in self._tok.get_added_tokens_decoder().values()}.get(token)
        return (False, False) if added is None else (bool(added.lstrip), bool(added.rstrip))

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


def llama_class_tokenizer(lib: Any, prepend_scheme: str, keep_added: bool, code_llama: bool = False,
                          unk_token: str | None = None) -> Any:
    """The tokenizer HF transformers builds for a directory whose tokenizer_config.json names the class
    LlamaTokenizer(Fast) (`LlamaTokenizer.__init__`): the vocabulary, merges and post-processor of the
    tokenizer.json `lib`, and the class's own rules over what the file says: no normalizer; a Metaspace that puts
    "▁" for spaces and before the text as `prepend_scheme` says ("always", "first": only before the start of the
    whole text, not after a special token, "never"); a decoder that undoes it. The file's added tokens are kept
    where `keep_added` (HF re-adds them unless tokenizer_config.json lists its own). `code_llama`: the same as
    CodeLlamaTokenizer builds it, whose BPE knows `unk_token` and whose decoder strips the first space whatever
    the scheme (its post-processor the caller sets: `bos_eos_processor`). A model other than BPE is the file's
    tokenizer unchanged."""
    from tokenizers import pre_tokenizers

    unk = {"unk_token": unk_token} if code_llama and unk_token is not None else {}
    return _as_class(lib, keep_added, dict(fuse_unk=True, byte_fallback=True, **unk), None,
                     pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend_scheme, split=False),
                     llama_class_decoder("first" if code_llama else prepend_scheme))


def qwen2_class_tokenizer(lib: Any, add_prefix_space: bool, keep_added: bool) -> Any:
    """The tokenizer HF transformers builds for a directory it loads with its Qwen2Tokenizer class: the vocabulary,
    merges and post-processor of the tokenizer.json `lib`, with the class's rules over the file's: NFC
    normalization, text split by Qwen2's expression (digits one by one) then byte-level, a space put before each
    split where `add_prefix_space`, a byte-level decoder. The file's added tokens are kept where `keep_added`. A
    model other than BPE is the file's tokenizer unchanged."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    bpe = dict(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    return _as_class(lib, keep_added, bpe, normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)]), decoders.ByteLevel())


def _as_class(lib: Any, keep_added: bool, bpe: dict[str, Any], normalizer: Any, pre_tokenizer: Any,
              decoder: Any) -> Any:
    """The tokenizer.json `lib`'s vocabulary, merges and post-processor under a tokenizer class's own rules: its
    BPE options `bpe`, normalizer (None: none), pre-tokenizer and decoder; the file's added tokens kept where
    `keep_added`. A model other than BPE is `lib` unchanged."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import models

    model = json.loads(lib.to_str())["model"]
    if model.get("type") != "BPE":
        return lib
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    tok = _Tok(models.BPE(vocab=model["vocab"], merges=merges, dropout=None, **bpe))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.post_processor = lib.post_processor
    if keep_added:
        tok.add_tokens([t for _, t in sorted(lib.get_added_tokens_decoder().items())])
    return tok


def llama_class_decoder(prepend_scheme: str) -> Any:
    """The decoder of HF's LlamaTokenizer class: "▁" back to spaces, byte pieces to bytes, and the one space
    before the whole text off where the Metaspace puts "▁" there."""
    from tokenizers import decoders

    strip = [decoders.Strip(content=" ", left=1)] if prepend_scheme != "never" else []
    return decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])


def bos_eos_processor(lib: Any, bos: str | None, eos: str | None) -> Any:
    """A post-processor that puts `bos` before a text and `eos` after it (None, or no token of `lib`: nothing), as
    HF's `TokenizersBackend.update_post_processor` writes one."""
    from tokenizers import processors

    b, e = [(t, lib.token_to_id(t)) if t is not None and lib.token_to_id(t) is not None else None for t in (bos, eos)]
    single = f"{b[0] + ':0 ' if b else ''}$A:0{' ' + e[0] + ':0' if e else ''}"
    pair = f"{single}{' ' + b[0] + ':1' if b else ''} $B:1{' ' + e[0] + ':1' if e else ''}"
    ends = list(dict.fromkeys(x for x in (b, e) if x))  # BOS and EOS may be one token
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)


def read_tokenizer_json(path: str | Path) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json, or TokenizerError naming the file."""
    from tokenizers import Tokenizer as _Tok

    try:
        with utf8_name(path) as name:
            return _Tok.from_file(name)
    except Exception as e:
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None


def _unique(ids: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(ids))


# How llama.cpp splits text before byte-level BPE, by GGUF `tokenizer.ggml.pre` (llama-vocab.cpp):
# (regex for a Split pre-tokenizer or None for GPT-2's own, digits one by one?, ignore_merges?).
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 and Qwen3: digits one by one
BPE_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "gpt-2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "refact": (_GPT2_SPLIT, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "qwen2": (_QWEN2_SPLIT, False, False),
}
# Where a gpt2 vocabulary's file has no `tokenizer.ggml.add_bos_token`, llama.cpp adds BOS after these (Llama 3's).
BOS_BY_DEFAULT = {"llama-bpe", "llama3"}


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def trained_byte_bpe(texts: Sequence[str], vocab_size: int = 300, chat_template: str | None = CHATML
                     ) -> HFTokenizer:
    """A byte-level BPE trained on `texts` (any UTF-8 text encodes): ids 0, 1, 2 the control tokens
    <|endoftext|>, <|im_start|> (BOS) and <|im_end|> (EOS), as SmolLM2's, with a ChatML template. For random
    models where no checkpoint's tokenizer is at hand (the tests; gpu_check's served run)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    return HFTokenizer(tok, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=chat_template)


def byte_bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str,
                       *, bos_id: int | None, add_bos: bool, eos_id: int | None = None, add_eos: bool = False) -> Any:
    """A `tokenizers.Tokenizer` for a GGUF `gpt2` vocabulary: BPE over byte-level symbols, text split
    as llama.cpp splits it for this `pre` type, control tokens matched whole as special tokens; BOS and EOS
    added around a sequence by its post-processor as the `add_*` flags say (llama.cpp adds each on its own)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    if pre not in BPE_PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r} (supported: {', '.join(BPE_PRE_TOKENIZERS)})")
    split, single_digits, ignore_merges = BPE_PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else () for m in merges]
    for k, (m, pair) in enumerate(zip(merges, pairs)):
        if len(pair) != 2 or not all(pair):  # byte-level tokens hold no space: "a b" is the whole grammar
            raise TokenizerError(f"tokenizer.ggml.merges[{k}] {m!r} is not two tokens joined by one space")
    try:
        tok = _Tok(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:  # noqa: BLE001 - the library's own words for a merge it cannot use
        raise TokenizerError(f"tokenizer.ggml.merges: not usable BPE merges ({e})") from None
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
    bos, eos = [tokens[i] if add and i is not None else None for i, add in ((bos_id, add_bos), (eos_id, add_eos))]
    if bos is not None or eos is not None:
        tok.post_processor = bos_eos_processor(tok, bos, eos)
    return tok

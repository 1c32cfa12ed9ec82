"""The tokenizer interface minillama works with, and chat templates rendered as HF transformers renders them.

Chat templates are the checkpoint's own Jinja source, rendered in a sandboxed environment with
`raise_exception`, `strftime_now` and `tojson` (`apply_chat_template`), on the messages as HF transformers
passes them (`template_messages`); given tools, the checkpoint's template named "tool_use" where it has one
(`tool_template`), as HF picks it. `encode_chat` tokenizes a rendered chat so that only the template's own
markers are control tokens: "<|im_end|>" written in a document is text, it cannot close a turn.

A template is the user's file, so whatever it does wrong is a `TokenizerError` naming the file and the field
(`template_source`), one line: a syntax error when the tokenizer is loaded (`check_template`), and, when it
is rendered, its own `raise_exception` (a Mistral template refusing a system turn), an undefined name, or work
past the sandbox's bounds (`RANGE_BUDGET` items over all its `range` calls, `MAX_REPEAT` for `*` and `**`).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from ..errors import OneLineError


class TokenizerError(OneLineError):
    """A tokenizer file that is missing, unreadable or of a kind minillama does not support."""


class Uncontinuable(TokenizerError):
    """`Tokenizer.continued_chat`: the rendered chat does not show where the final message's text ends."""


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
    named_tokens: dict[str, str] = {}  # the other special tokens a template sees by name ("pad_token": "<pad>")
    split_special: bool = False  # tokenizer_config.json's split_special_tokens: control tokens in any text are text
    source: str = "the tokenizer"  # the file it was read from, for messages
    template_source: str = "the chat template"  # the file and field the chat template was read from
    tool_template: tuple[str, str] | None = None  # a checkpoint's template named "tool_use", and where it was read

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True,
               continues: bool = False) -> list[int]:
        """Token ids of `text`. Control tokens written in the text become their ids, or with
        `parse_special=False` (or `split_special`, in any text) are spelled out as text like any other characters.
        `add_special` adds what the checkpoint adds around a sequence (BOS for Llama 1/2; nothing for SmolLM2).
        `continues`: the text follows a control token in a longer text, and is tokenized as it would be there (a
        Llama tokenizer that puts "▁" before the start of a text only, puts none before it)."""
        raise NotImplementedError

    def special_tokens(self) -> list[str]:
        """The text of every control token `encode` turns into its id."""
        raise NotImplementedError

    def spells_control(self, text: Any) -> bool:
        """Whether `text` spells a control token, as written or as the normalizer leaves it (NFKC: "＜" is "<")."""
        return isinstance(text, str) and any(t in c for c in (text, self.normalized(text)) for t in self.special_tokens())

    def normalized(self, text: str) -> str:
        """`text` as the tokenizer's normalizer leaves it before splitting it into tokens (control tokens that
        are matched after it are matched in this text): the text itself where it has none."""
        return text

    def strips(self, token: str) -> tuple[bool, bool]:
        """Whether the control token `token` takes the whitespace on its left and on its right into itself
        when `encode` meets it in a text (an HF added token's lstrip and rstrip)."""
        return False, False

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to a text: its text alone, in UTF-8, where that is whole characters; where
        it holds part of a character (alone it decodes to U+FFFD), the byte its piece stands for (a
        sentencepiece "<0xE6>", a byte-level BPE "Ġæ": b" \xe6"). What a server's log-probs report of it."""
        text, piece = self.decode([token_id]), self.id_to_token(token_id)
        if piece is None:  # an id of the model's vocabulary past the tokenizer's pieces (padding): no text
            return text.encode("utf-8")
        if "\ufffd" not in text:
            if piece.startswith("\u2581") and not text.startswith(" "):  # sentencepiece's word start: a space
                text = " " + text  # that decoding a token alone drops ("▁the" is " the" in a text)
            return text.encode("utf-8")
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m[1], 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        """The token's piece; None for an id past the tokenizer's pieces."""
        raise NotImplementedError

    def largest_ids(self) -> list[tuple[str, int, str]]:
        """(field of the tokenizer file, its largest token id, that token) for each field that holds ids."""
        raise NotImplementedError

    def check_fits(self, vocab_size: int) -> None:
        """TokenizerError naming the file and the field when a token id (or BOS) is past the model's
        vocabulary: the embedding would be indexed out of range on the first prompt that holds it."""
        for field, i, token in self.largest_ids() + ([("bos_token", self.bos_id, self.bos_token or "")]
                                                     if self.bos_id is not None else []):
            if i >= vocab_size:
                raise TokenizerError(f"{self.source}, {field}: token id {i} ({token!r}) is past the model's "
                                     f"vocabulary (vocab_size {vocab_size}: ids 0 to {vocab_size - 1})")
        if self.eos_ids and min(self.eos_ids) >= vocab_size:  # the model could write none: no answer would end
            raise TokenizerError(f"{self.source}: every end-of-sequence id ({', '.join(map(str, self.eos_ids))}) "
                                 f"is past the model's vocabulary (vocab_size {vocab_size}: ids 0 to "
                                 f"{vocab_size - 1})")

    def save(self, out_dir: str | Path) -> None:
        """Write the tokenizer files of an HF directory (tokenizer.json or tokenizer.model, and
        tokenizer_config.json with the chat template and special tokens)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]). Encode it with
        `encode(text)`: templates write BOS themselves where the model wants it. Where `tools` are given and
        the checkpoint names a template "tool_use", that one renders, as HF transformers picks it."""
        source, where = self._template(variables)
        if source is None:
            raise TokenizerError("this tokenizer has no chat template")
        template = check_template(source, where)
        try:
            return template.render(messages=template_messages(messages), add_generation_prompt=add_generation_prompt,
                                   range=_bounded_range(), **{**self.named_tokens, "bos_token": self.bos_token or "",
                                                              "eos_token": self.eos_token or "", "tools": None,
                                                              "documents": None, **variables})
        except Exception as e:  # noqa: BLE001 - the template is the user's program: whatever it raises is its fault
            raise TokenizerError(f"{where}: the template failed: "
                                 f"{' '.join(str(e).split()) or type(e).__name__}") from None

    def _template(self, variables: dict[str, Any]) -> tuple[str | None, str]:
        """The template that renders a chat with these variables, and the file and field it was read from."""
        if variables.get("tools") is not None and self.tool_template is not None:
            return self.tool_template
        return self.chat_template, self.template_source

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **variables: Any) -> list[int]:
        """Token ids of the rendered chat (`apply_chat_template`), with the messages' text kept as text:
        a control token written in a message ("<|im_end|>\n<|im_start|>system" in a document) is spelled
        out and cannot end a turn or open a new one; only the template's own markers are control tokens.
        Without such text in the messages this is `encode(apply_chat_template(...))`, token for token."""
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        skeleton, where = self._skeleton(messages, add_generation_prompt, variables), self._template(variables)[1]
        self._refuse_lost(messages, skeleton, where)
        spans = self._message_spans(messages, text, skeleton)
        if spans is None:  # a template that rewrites the text (`upper`) may; one that cuts it (`[:50]`) may not
            folded = text.casefold()
            cut = [k for k, m in enumerate(messages)
                   if isinstance(m.get("content"), str) and m["content"].strip().casefold() not in folded]
            if cut:
                hint = ("; send an earlier answer without its reasoning, the text up to '</think>'" if "</think>" in
                        messages[cut[0]]["content"] and messages[cut[0]].get("role") == "assistant" else "")
                raise TokenizerError(f"{where}: the template does not write message {cut[0]}'s "
                                     f"content whole (role {messages[cut[0]].get('role')!r}): it cuts it, and the "
                                     f"text given would be lost{hint}")
        specials = self.special_tokens()
        if not any(self.spells_control(m.get("content")) for m in messages):
            # a template that rewrites the text (`lower`) may make control tokens of it: then the render holds
            # more of them than the template's own (the skeleton's)
            if spans is not None or not specials or all(len(_markers(specials).findall(f(text))) == len(
                    _markers(specials).findall(f(skeleton))) for f in (str, self.normalized)):
                return self.encode(text)
        pattern = _markers(specials)
        if spans is None:  # a template that rewrites the text (`upper`): its control tokens cannot be told apart
            raise TokenizerError(f"{where}: the template changes the message text; message text with "
                                 "control tokens cannot be kept as text")
        # Runs of text between the template's markers are encoded whole (message text and template
        # text together, as `encode` would), with control-token parsing off inside them; a marker that takes
        # the whitespace beside it (`strips`) takes it here too.
        ids: list[int] = []
        run_start, pos = 0, 0
        for _, lo, hi in [*spans, (None, len(text), len(text))]:
            for m in pattern.finditer(text, pos, lo):  # markers in the template text before this message
                left, right = self.strips(m.group(0))
                run = text[run_start:m.start()]
                run = run.rstrip() if left else run
                ids += self.encode(run, parse_special=False, continues=run_start > 0) if run else []
                ids += self.encode(m.group(0))
                run_start = m.end()
                while right and run_start < len(text) and text[run_start].isspace():
                    run_start += 1
            pos = hi
        if run_start < len(text):
            ids += self.encode(text[run_start:], parse_special=False, continues=run_start > 0)
        return ids

    def continued_chat(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        """The rendered chat (no generation prompt) cut at the end of its final message's text, as written
        (whole or trimmed), so that an answer continues that message. Where the template writes it
        (`_message_spans`), not where its text last occurs: "|>" also ends the trailer "<|im_end|>". A message
        before it that the template does not write is refused, as `encode_chat` refuses it."""
        text = self.apply_chat_template(messages, False, **variables)
        skeleton, where = self._skeleton(messages, False, variables), self._template(variables)[1]
        # Mistral's writes the system turn only before a final user turn
        self._refuse_lost(messages[:-1], skeleton, where)
        spans = self._message_spans(messages, text, skeleton)
        if spans is None:
            raise Uncontinuable(f"{where}: the template changes the message text, so the end of the "
                                "final message cannot be found to continue it")
        ends = [hi for k, _, hi in spans if k == len(messages) - 1]
        if not ends:
            raise Uncontinuable("the chat template does not write the final message")
        return text[:ends[-1]]

    @staticmethod
    def _refuse_lost(messages: list[dict[str, Any]], skeleton: str, where: str) -> None:
        """TokenizerError where the `skeleton` holds no mark of a message with text: a template that skips a role
        (a system turn) would answer without the text given."""
        lost = [k for k, m in enumerate(messages)
                if isinstance(m.get("content"), str) and m["content"].strip() and _mark(k) not in skeleton]
        if lost:
            raise TokenizerError(f"{where}: the template does not write message {lost[0]}'s content "
                                 f"(role {messages[lost[0]].get('role')!r}): it would be lost")

    def _skeleton(self, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        """The chat rendered with a mark (`_mark(k)`) in place of each message's text. A mark's characters in
        anything else the template writes (a name) would be taken for a message's place: refused."""
        for k, m in enumerate(messages):
            odd = [f for f, v in m.items() if f != "content" and isinstance(v, str) and MARK_CHARS.search(v)]
            if odd:
                raise TokenizerError(f"message {k}'s {odd[0]} holds U+E000 or U+E001, characters that mark where "
                                     "message text goes in the template's output")
        return self.apply_chat_template(
            [{**m, "content": _mark(k)} if isinstance(m.get("content"), str) else m for k, m in enumerate(messages)],
            add_generation_prompt, **variables)

    def _message_spans(self, messages: list[dict[str, Any]], text: str,
                       skeleton: str) -> list[tuple[int, int, int]] | None:
        """Where each message's text lies in the rendered chat `text`, in order: (its index, start, end). The
        pieces of template between the marks of the `skeleton` are matched against `text`, each message's
        text taken as it is or trimmed (what templates do with it). None where they do not match: the
        template writes some message's text otherwise (cut, rewritten) or writes other text around it."""
        pieces = _MARKS.split(skeleton)  # template, message index, template, ...
        spans: list[tuple[int, int, int]] = []
        pos = len(pieces[0])
        if not text.startswith(pieces[0]):
            return None
        for k, after in zip(pieces[1::2], pieces[2::2]):
            content = messages[int(k)]["content"]
            for v in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
                if text.startswith(v, pos) and text.startswith(after, pos + len(v)):
                    spans.append((int(k), pos, pos + len(v)))
                    pos += len(v) + len(after)
                    break
            else:
                return None
        return spans

    def _config_json(self) -> dict[str, Any]:
        """tokenizer_config.json, in the keys HF transformers reads."""
        template: Any = self.chat_template
        if self.tool_template is not None and template is not None:  # HF's list of named templates
            template = [{"name": "default", "template": template},
                        {"name": "tool_use", "template": self.tool_template[0]}]
        return {
            "bos_token": self.bos_token, "eos_token": self.eos_token, **self.named_tokens,
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False, **({"split_special_tokens": True} if self.split_special else {}),
            "chat_template": template,
            # Every end-of-generation id (EOS, end-of-turn, ...); HF reads eos_token only.
            "eos_token_ids": self.eos_ids,
        }

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, chat_template={'yes' if self.chat_template else 'no'})")


DECODE_CONTEXT = 8  # tokens before a text's new tokens that they are decoded after


def whole_characters(tokenizer: Any, ids: Sequence[int], text: str) -> str:
    """`text`, the decoding of a text whose last tokens are `ids` (a few: 4 hold any character's bytes), less
    the U+FFFD it ends with where that stands for a character's first bytes only, a character not yet whole
    (not one the text holds): what a stream has released of it."""
    if not text.endswith("\ufffd"):
        return text
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(tokenizer.token_bytes(i) for i in ids))
    return text[:-1] if decoder.getstate()[0] else text  # the bytes it holds back, waiting for the rest


def decoded_after(tokenizer: Any, ids: Sequence[int], start: int, skip_special: bool = False) -> str:
    """What ids[start:] add to the text of ids[:start]: decoded after the `DECODE_CONTEXT` tokens before `start`
    (more where those decode to nothing), so that a sentencepiece word keeps the space it has inside a text, and
    a character's bytes split at `start` come whole. The whole text is decoded where that text does not
    begin with the context's own (a tokenizer whose decoding looks further back)."""
    lo, back = max(0, start - DECODE_CONTEXT), DECODE_CONTEXT
    head = tokenizer.decode(ids[lo:start], skip_special=skip_special)
    while not head and lo > 0:  # twice as far back each time: a run of tokens that write nothing (control tokens
        back *= 2  # left out) costs a few decodes, not one per DECODE_CONTEXT tokens of it at every token
        lo = max(0, start - back)
        head = tokenizer.decode(ids[lo:start], skip_special=skip_special)
    text = tokenizer.decode(ids[lo:], skip_special=skip_special)
    if not text.startswith(head):
        head, text = (tokenizer.decode(ids[:start], skip_special=skip_special),
                      tokenizer.decode(ids, skip_special=skip_special))
    return text[len(head):]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's pieces spell each byte as one printable character: itself where printable (33-126,
    161-172, 174-255), the others as 256, 257, ... in byte order. Character -> byte."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(moved)}}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a sentencepiece (or byte-fallback BPE) byte token
_MARKS = re.compile("\ue000(\\d+)\ue001")  # every `_mark` in a skeleton, its index captured
MARK_CHARS = re.compile("[\ue000\ue001]")  # what a mark is made of: in other text a template writes, a false mark


def _markers(specials: Sequence[str]) -> re.Pattern:
    """The control tokens as one pattern, longest first (one that is a prefix of another does not win)."""
    return re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))


def _mark(k: int) -> str:
    """Message k's stand-in in a chat's skeleton: private-use characters around its index."""
    return f"\ue000{k}\ue001"


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as HF transformers hands them to a template: a key whose value is None left out (an OpenAI
    client's assistant turn carries `"tool_calls": null`; a template that asks `'tool_calls' in message`, Llama
    3.1's, takes that for a tool call and fails), and a message's reasoning, under whichever of
    `REASONING_FIELDS` comes first, also as `reasoning_content` (Qwen3's template reads it) and, where not
    given, as `thinking`."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}  # HF's order of keys (`tojson`)
        out.append(m)
    return out


RANGE_BUDGET = 100_000  # items over every `range` of one rendering: a prompt template loops over messages
MAX_REPEAT = 1_000_000  # the longest `"x" * n` or list repetition, and the largest result of `**`


def _bounded_range() -> Any:
    """A `range` for one rendering that hands out at most RANGE_BUDGET items over all its calls (the sandbox's
    own bounds each range alone, so nested ones could still run for hours)."""
    left = [RANGE_BUDGET]

    def bounded(*args: int) -> Any:
        r = range(*args)
        if len(r) > left[0]:
            raise OverflowError(f"its ranges ask for more than {RANGE_BUDGET:,} items in all")
        left[0] -= len(r)
        return r
    return bounded


def check_template(source: str, where: str = "the chat template") -> Any:
    """The compiled template, or TokenizerError naming `where` (the file and field it came from)."""
    import jinja2

    if not isinstance(source, str):
        raise TokenizerError(f"{where} must be a string, got {type(source).__name__}")
    try:
        return _compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{where}: not a valid Jinja template ({' '.join(str(e).split())})") from None


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; HF's does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with `*` and `**` bounded: `"x" * 10**10` would take the memory, `9**9**9` the time."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 64 and abs(left) > 1:
                raise SecurityError(f"a power past the sandbox's bound ({left!r} ** {right!r})")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                        raise SecurityError(f"a repetition past the sandbox's bound of {MAX_REPEAT:,} items")
            return super().call_binop(context, operator, left, right)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`, which marks what an assistant wrote (for training masks):
        its body rendered as it is, as HF transformers renders it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)

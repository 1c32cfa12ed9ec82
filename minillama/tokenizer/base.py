"""The tokenizer interface minillama works with, and chat templates rendered as HF transformers renders them.

Chat templates are the checkpoint's own Jinja source, rendered in a sandboxed environment with
`raise_exception`, `strftime_now` and `tojson` (`apply_chat_template`). `encode_chat` tokenizes a rendered
chat so that only the template's own markers are control tokens: "<|im_end|>" written in a document is
text, it cannot close a turn.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from ..errors import OneLineError


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

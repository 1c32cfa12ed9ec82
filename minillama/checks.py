"""What the Python API and the command line check before any work, in one place.

`check_options` checks every option of `api.ask_many` (the CLI's options are the same values), naming
the option as the caller spells it (`max_new_tokens` for the API, `--max-new-tokens` for the CLI);
`check_jobs` checks the documents and questions (text, not bytes; not empty; encodable as UTF-8); and
`too_long` refuses a document or question that cannot fit in the model's context from its length in
characters alone, before the slow part (rendering and tokenizing every question's prompt).
Every refusal is a `BadInput` (a ValueError), or a `BadType` (also a TypeError) for a value of the
wrong type, in one line.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Callable, Sequence

from .errors import BadInput
from .generate import MODES


class BadType(BadInput, TypeError):
    """A value of the wrong type (a string where a list belongs, bytes where text belongs)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy's integers too


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_options(*, mode: Any = "parallel", max_new_tokens: Any = 64, temperature: Any = 0.0, top_k: Any = 0,
                  top_p: Any = 1.0, seed: Any = 0, ignore_eos: Any = False, stop: Any = (),
                  parallel_size: Any = None, batch_docs: Any = None, prefill_chunk: Any = 512,
                  system: Any = None, chat_template: Any = True, keep_logits: Any = False,
                  spell: Callable[[str], str] = str) -> tuple[str, ...]:
    """Raise BadInput for the first bad option; returns the stop strings as a tuple (one string, as
    OpenAI, vLLM and HF take it, is one stop string). `spell` names an option the caller's way."""
    def need(ok: bool, name: str, what: str, value: Any, kind: type = BadInput) -> None:
        if not ok:
            raise kind(f"{spell(name)} must be {what}, got {value!r}")

    need(isinstance(mode, str) and mode in MODES, "mode", f"one of {', '.join(MODES)}", mode)
    need(_is_int(max_new_tokens), "max_new_tokens", "an integer", max_new_tokens, BadType)
    need(max_new_tokens >= 0, "max_new_tokens", ">= 0", max_new_tokens)
    need(_is_real(temperature), "temperature", "a number", temperature, BadType)
    need(math.isfinite(temperature) and temperature >= 0, "temperature", "a finite number >= 0", temperature)
    need(_is_int(top_k), "top_k", "an integer", top_k, BadType)
    need(top_k >= 0, "top_k", ">= 0 (0: off)", top_k)
    need(_is_real(top_p), "top_p", "a number", top_p, BadType)
    need(0 < top_p <= 1, "top_p", "in (0, 1] (1: off)", top_p)
    need(_is_int(seed), "seed", "an integer", seed, BadType)
    for name, v in (("parallel_size", parallel_size), ("batch_docs", batch_docs)):
        if v is not None:
            need(_is_int(v), name, "an integer or None", v, BadType)
            need(v >= 1, name, "at least 1", v)
    need(_is_int(prefill_chunk), "prefill_chunk", "an integer", prefill_chunk, BadType)
    need(prefill_chunk >= 1, "prefill_chunk", "at least 1", prefill_chunk)
    for name, v in (("ignore_eos", ignore_eos), ("chat_template", chat_template), ("keep_logits", keep_logits)):
        need(isinstance(v, bool), name, "True or False", v, BadType)
    if system is not None:
        need(isinstance(system, str), "system", "a string or None", system, BadType)
        _text(system, spell("system"))
    stops = (stop,) if isinstance(stop, str) else stop
    need(isinstance(stops, (list, tuple)), "stop", "a string or a list of strings", stop, BadType)
    for s in stops:
        need(isinstance(s, str), "stop", "a string or a list of strings", stop, BadType)
        need(s != "", "stop", "non-empty", s)
        _text(s, spell("stop"))
    return tuple(stops)


def _text(s: str, where: str) -> None:
    """Text that can be encoded: a lone surrogate (from a JSON "\\ud800" escape) is not a character."""
    m = re.search("[\ud800-\udfff]", s)
    if m:
        raise BadInput(f"{where}: a lone surrogate U+{ord(m.group()):04X} at character {m.start()} is not "
                       "text (it cannot be encoded as UTF-8)")


def check_jobs(jobs: Any) -> list[tuple[str, list[str]]]:
    """(document, questions) pairs as lists of text; raises BadInput/BadType naming the bad one."""
    if isinstance(jobs, (str, bytes)) or not isinstance(jobs, Sequence):
        raise BadType(f"jobs must be a list of (document, questions) pairs, got {type(jobs).__name__}")
    out = []
    for d, job in enumerate(jobs, 1):
        if isinstance(job, (str, bytes)) or not isinstance(job, Sequence) or len(job) != 2:
            raise BadType(f"job {d} must be a (document, questions) pair")
        doc, questions = job
        if isinstance(doc, (bytes, bytearray)):
            raise BadType(f"document {d} is bytes; decode it to str first (e.g. data.decode('utf-8'))")
        if not isinstance(doc, str):
            raise BadType(f"document {d} must be a string, got {type(doc).__name__}")
        if not doc.strip():
            raise BadInput(f"document {d} is empty")
        _text(doc, f"document {d}")
        if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence):
            raise BadType(f"the questions of document {d} must be a list of strings, not one "
                          f"{type(questions).__name__}")
        if not questions:
            raise BadInput(f"document {d} has no questions")
        for k, q in enumerate(questions, 1):
            if not isinstance(q, str):
                raise BadType(f"document {d}, question {k} must be a string, got {type(q).__name__}")
            if not q.strip():
                raise BadInput(f"document {d}, question {k} is empty")
            _text(q, f"document {d}, question {k}")
        out.append((doc, list(questions)))
    return out


# Characters no tokenizer normalization is sure to keep (whitespace may be collapsed, control and
# zero-width characters dropped); the rest survive, at worst composed a few into one by NFKC.
_DROPPABLE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028-\u202f\u2060-\u206f\ufeff]+")
NORMALIZATION_SLACK = 4  # NFKC composes at most a few characters into one


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary can stand for (its longest piece), cached."""
    n = getattr(tokenizer, "_longest_token", None)
    if n is None:
        n = max((len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)), default=1)
        try:
            tokenizer._longest_token = n = max(n, 1)
        except AttributeError:
            pass
    return n


def too_long(tokenizer: Any, jobs: Sequence[tuple[str, Sequence[str]]], context: int) -> str | None:
    """Why some prompt cannot fit in `context` tokens, judged from character counts alone (one pass over
    the text); None when it may fit (then the tokenized prompts decide). Every token stands for at most
    `longest_token` characters, so a prompt holds at least (kept characters) / (that x slack) tokens."""
    if not hasattr(tokenizer, "id_to_token"):
        return None
    per_token = longest_token(tokenizer) * NORMALIZATION_SLACK
    for d, (doc, questions) in enumerate(jobs, 1):
        kept = len(_DROPPABLE.sub("", doc))
        for k, q in enumerate(questions, 1):
            least = (kept + len(_DROPPABLE.sub("", q))) // per_token
            if least >= context:
                return (f"document {d}, question {k}: the prompt has at least {least} tokens ({len(doc) + len(q)} "
                        f"characters), the model's context is {context}")
    return None

"""What the Python API and the command line check before any work, in one place.

`check_options` checks options of `api.ask_many` by their rows in the option table (`options.py`): the
run's own (`RUN_OPTIONS`, here) and the sampling ones (`SAMPLING_OPTIONS`, declared on `SamplingParams`),
naming the option as the caller spells it (`max_new_tokens` for the API, `--max-new-tokens` for the CLI);
`check_jobs` checks the documents and questions (text, not bytes; not empty; encodable as UTF-8); and
`too_long` refuses a document or question that cannot fit in the model's context from its length in
characters alone (those the tokenizer keeps), before the slow part (rendering and tokenizing every question's prompt).
Every refusal is a `BadInput` (a ValueError), or a `BadType` (also a TypeError) for a value of the
wrong type, in one line.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from . import options
from .errors import BadInput
from .generate import MODES, SamplingParams
from .options import BadType, Option, text as _text

__all__ = ["BadType", "OPTIONS", "RUN_OPTIONS", "SAMPLING_OPTIONS", "check_options", "check_jobs", "too_long"]

_COUNT = (options.INTEGER, options.at_least(1))
_SOME = (options.need(options.is_int, "an integer or None", BadType, optional=True),
         options.at_least(1, optional=True))

# api.ask_many's options that are not SamplingParams fields: how the questions are scheduled and prompted.
RUN_OPTIONS: dict[str, Option] = {
    "mode": Option("parallel (default): one document, all its questions packed; independent: each question "
                   "alone; seqbatch: one stream, question after answer after question", (options.one_of(MODES),),
                   "--mode", metavar="{" + ",".join(MODES) + "}", default="parallel"),
    "parallel_size": Option("most questions of one document decoded together (default: as many as --max-memory "
                            "allows)", _SOME, "--parallel-size", metavar="P", parse=int),
    "batch_docs": Option("documents per forward pass (default: as many as --max-memory allows)", _SOME,
                         "--batch-docs", metavar="N", parse=int),
    "prefill_chunk": Option("most prompt tokens per prefill pass", _COUNT, default=512,
                            no_flag="a knob of the Python API's callers (the benchmark), not of answers"),
    "system": Option("system prompt (default: the chat template's own)",
                     (options.need(lambda v: isinstance(v, str), "a string or None", BadType, optional=True),
                      options.text), "--system", metavar="TEXT", group="prompt"),
    "chat_template": Option("plain text instead of the chat template: the document, then 'Question: ...' and "
                            "'Answer:'", (options.BOOLEAN,), "--no-chat-template", action="store_false",
                            group="prompt", default=True),
}
SAMPLING_OPTIONS: dict[str, Option] = options.table(SamplingParams)
# Every option of api.ask_many, in the command line's order of help.
OPTIONS: dict[str, Option] = {"mode": RUN_OPTIONS["mode"], **SAMPLING_OPTIONS, **RUN_OPTIONS}


def check_options(*, spell: Callable[[str], str] = str, **values: Any) -> None:
    """Raise BadInput (BadType for a wrong type) for the first bad value of the options given by name;
    `spell` names an option the caller's way. An unknown name is a TypeError, as Python's own."""
    for name, value in values.items():
        if name not in OPTIONS:
            raise TypeError(f"unexpected keyword argument {name!r}")
        OPTIONS[name].check(spell(name), value)
    mode = values.get("mode", "parallel")
    for name in ("parallel_size", "batch_docs"):  # once read by nothing in the other modes, without a word
        if values.get(name) is not None and mode != "parallel":
            raise BadInput(f"{spell(name)} sizes parallel mode's passes; {spell('mode')} {mode} answers one question "
                           f"at a time: drop {spell(name)}")


def flag(name: str) -> str:
    """An option's name on the command line (`top_k` -> `--top-k`)."""
    return OPTIONS[name].flag or name


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


# Characters some tokenizer normalization drops (whitespace may be collapsed, control and zero-width
# characters dropped); the rest survive, at worst composed a few into one by NFKC. Which of them a given
# tokenizer does drop is asked of it (`dropped`): 10 MB of zero-width spaces are 10 MB of text to a byte-level
# BPE, and must count as such.
_DROPPABLE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028-\u202f\u2060-\u206f\ufeff]+")
NORMALIZATION_SLACK = 4  # NFKC composes at most a few characters into one


def dropped(tokenizer: Any) -> re.Pattern | None:
    """The characters of `_DROPPABLE` this tokenizer may drop or collapse, as a pattern of runs of them (None:
    it keeps every one), cached on the tokenizer. A character counts as kept when eight of them between two
    letters come back from encode and decode as eight."""
    cached = getattr(tokenizer, "_dropped", False)
    if cached is not False:
        return cached
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        pattern = _DROPPABLE
    else:
        drops = []
        for c in map(chr, [*range(0x3001), 0xFEFF]):
            if _DROPPABLE.fullmatch(c):
                try:
                    kept = c * 8 in tokenizer.decode(tokenizer.encode(f"a{c * 8}a", parse_special=False))
                except Exception:  # noqa: BLE001 - a tokenizer of one's own that cannot say: assume dropped
                    kept = False
                if not kept:
                    drops.append(c)
        pattern = re.compile("[" + "".join(map(re.escape, drops)) + "]+") if drops else None
    try:
        tokenizer._dropped = pattern
    except AttributeError:
        pass
    return pattern


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


def _measure(tokenizer: Any) -> tuple[Callable[[str], int], int] | None:
    """(the characters of a text the tokenizer keeps, the most of them one token stands for x slack), or None
    where the tokenizer cannot say: a text holds at least the first // the second tokens."""
    if not hasattr(tokenizer, "id_to_token"):
        return None
    drop, norm = dropped(tokenizer), getattr(tokenizer, "normalized", None)

    def count(text: str) -> int:  # what the normalizer leaves (StripAccents drops combining marks), less drops
        text = norm(text) if norm is not None else text
        return len(text) if drop is None else len(drop.sub("", text))
    return count, longest_token(tokenizer) * NORMALIZATION_SLACK


def fewest_tokens(tokenizer: Any, text: str) -> int:
    """The fewest tokens `text` can encode to, from its characters alone (0 where the tokenizer cannot say):
    what `too_long` counts, for one text (a server's prompt, refused before a megabyte is tokenized)."""
    measure = _measure(tokenizer)
    return 0 if measure is None else measure[0](text) // measure[1]


def too_long(tokenizer: Any, jobs: Sequence[tuple[str, Sequence[str]]], context: int) -> str | None:
    """Why some prompt cannot fit in `context` tokens, judged from character counts alone (one pass over
    the text); None when it may fit (then the tokenized prompts decide). Every token stands for at most
    `longest_token` characters, so a prompt holds at least (kept characters) / (that x slack) tokens."""
    measure = _measure(tokenizer)
    if measure is None:
        return None
    count, per_token = measure
    for d, (doc, questions) in enumerate(jobs, 1):
        kept = count(doc)
        for k, q in enumerate(questions, 1):
            least = (kept + count(q)) // per_token
            if least >= context:
                return (f"document {d}, question {k}: the prompt has at least {least} tokens ({len(doc) + len(q)} "
                        f"characters), the model's context is {context}")
    return None

"""The generate command's input: a document and its questions from text files, or many documents from JSON Lines.

Both are read in blocks and checked before anything slow happens: a file that is missing, binary or not UTF-8
(refused at its first bad block), longer than the model's context could hold (`input_limit`), an empty
document, no questions, a JSON line that is not a `{"doc": ..., "questions": [...]}` object, or text that is
not text (`checks.check_jobs`) is a `BadInput` naming the file and line. `--doc /dev/zero` or `yes | ... --doc -`
stop at the first block or at the limit, never at the end of memory.
"""

from __future__ import annotations

import argparse
import collections
import codecs
import json
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from .checks import check_jobs
from .errors import BadInput


BLOCK = 1 << 16  # bytes read at a time: a binary file is refused at its first block
# The most bytes one token stands for, with room to spare: a byte-level BPE token is at most its longest piece
# (81 bytes for SmolLM2), and real text averages about 4 bytes a token. A document longer than
# `context x BYTES_PER_TOKEN` (plus MARGIN, for the chat template and the question) cannot fit; the exact
# checks (`checks.too_long`, then the tokenized prompt) come once the model is loaded.
BYTES_PER_TOKEN = 256
MARGIN = 1 << 20
FILE_DOCUMENTS = 16  # a file of questions or of many documents holds at most this many documents' worth


def read_text(path: str, what: str, limit: int | None = None, bound: str = "") -> str:
    """A UTF-8 text file (or standard input for '-'), read in blocks of `BLOCK` bytes, at most `limit` (None:
    no bound; `bound` says why), with Windows line endings (\\r\\n) made \\n. A leading byte-order mark is
    dropped. A NUL byte or bytes that are not UTF-8 are refused in the block where they first appear."""
    if path == "-" and sys.stdin is None:
        raise BadInput(f"{what} -: standard input is closed")
    try:
        if path == "-":
            return _read_blocks(sys.stdin.buffer, path, what, limit, bound).replace("\r\n", "\n")
        with open(path, "rb") as f:
            return _read_blocks(f, path, what, limit, bound).replace("\r\n", "\n")
    except FileNotFoundError:
        raise BadInput(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{what} {path}: is a directory, not a file") from None
    except OSError as e:
        raise BadInput(f"{what} {path}: cannot read ({e.strerror or e})") from None


def _read_blocks(f: BinaryIO, path: str, what: str, limit: int | None, bound: str) -> str:
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    parts: list[str] = []
    n = 0
    while True:
        block = f.read(BLOCK)
        if not block:
            break
        if limit is not None and n + len(block) > limit:
            raise BadInput(f"{what} {path}: longer than {limit:,} bytes, {bound}")
        if b"\0" in block:
            raise BadInput(f"{what} {path}: a binary file, not UTF-8 text")
        held = decoder.getstate()[0]  # the start of a character the block before ended inside
        try:
            parts.append(decoder.decode(block))
        except UnicodeDecodeError:  # its start counts from the held bytes (or past a BOM): count from the file's
            try:
                (held + block).decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(f"{what} {path}: not UTF-8 text (invalid byte at offset {n - len(held) + e.start})"
                               ) from None
            raise
        n += len(block)
    try:
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        raise BadInput(f"{what} {path}: not UTF-8 text (the file ends inside a character)") from None
    return "".join(parts)


def model_context(path: str | None) -> int:
    """The checkpoint's context in tokens, from its config alone (read before the input, to bound how much of
    the input is worth reading: `read_jobs`); config.MAX_CONTEXT when it cannot be read here (loading
    it will say why)."""
    from .config import MAX_CONTEXT, LlamaConfig

    try:
        if path is None:
            from .weights import default_model_dir

            path = str(default_model_dir())
        p = Path(path)
        if p.is_dir() and (p / "config.json").exists():
            from .weights.hf import hf_config

            return min(hf_config(p / "config.json").context, MAX_CONTEXT)
        if p.is_dir() and (p / "params.json").exists():
            return min(LlamaConfig.from_meta_params(p / "params.json", 1).context, MAX_CONTEXT)
        if p.is_file():
            from .weights.gguf import gguf_metadata, open_gguf

            meta = gguf_metadata(open_gguf(p), p)
            arch = meta.get("general.architecture")
            return min(int(meta[f"{arch}.context_length"]), MAX_CONTEXT)
    except Exception:  # noqa: BLE001 - any fault of the checkpoint is the loader's to report, in its words
        pass
    return MAX_CONTEXT


def lines(text: str) -> list[str]:
    """Lines end at \\n only: U+2028, U+0085, form feeds and other characters `str.splitlines` also
    breaks at belong to the line (and are valid inside a JSON string). A byte-order mark that opens a line is
    dropped: it is where `cat a.txt b.txt` leaves the mark of a file saved with one, and not part of the text."""
    return [line.removeprefix("\ufeff") for line in text.split("\n")]


class RepeatedKey(ValueError):
    """A JSON object that gives one key twice: valid JSON, whose reader would keep the last value silently."""


def once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys differ (json.loads' object_pairs_hook), else RepeatedKey naming the key."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        twice = next(k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
        raise RepeatedKey(f"the key {twice!r} is given twice")
    return obj


def json_objects(text: str, where: Callable[[int], str], error: type[Exception],
                 expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each non-blank line of JSON Lines text; lines end at \\n only (`lines`). A line
    that is not a JSON object raises `error` naming where (`where(line number)`) and what was `expected`."""
    for n, line in enumerate(lines(text), 1):
        if not line.strip():
            continue
        at = where(n)
        try:
            obj = json.loads(line, object_pairs_hook=once_each)
        except RepeatedKey as e:
            raise error(f"{at}: {e}") from None
        except ValueError as e:
            raise error(f"{at}: not JSON ({e})") from None
        except RecursionError:
            raise error(f"{at}: JSON nested too deeply to read") from None
        if not isinstance(obj, dict):
            raise error(f"{at}: expected {expected}")
        yield at, obj


def read_jobs(args: argparse.Namespace, context: int | None = None) -> list[tuple[str, list[str]]]:
    """(document, questions) pairs from --doc/--questions or --input. With the model's `context` (in tokens),
    a document of more than `context x BYTES_PER_TOKEN + MARGIN` bytes is refused as it is read, and so is a
    file of questions or documents of more than FILE_DOCUMENTS times that."""
    limit = None if context is None else context * BYTES_PER_TOKEN + MARGIN
    many = None if limit is None else FILE_DOCUMENTS * limit
    fits = f"more than fits when the model's context is {context} tokens (at most {BYTES_PER_TOKEN} bytes a token)"
    bound = f"the most read from one file ({FILE_DOCUMENTS} documents' worth of the model's context); split it"
    if args.input is None:
        # a byte-order mark opening a line is dropped, as in the questions
        doc = "\n".join(lines(read_text(args.doc, "--doc", limit, fits)))
        if not doc.strip():
            raise BadInput(f"--doc {args.doc}: the document is empty")
        questions = [q.strip() for q in lines(read_text(args.questions, "--questions", many, bound)) if q.strip()]
        if not questions:
            raise BadInput(f"--questions {args.questions}: no questions (one per line)")
        return [(doc, questions)]
    jobs = []
    text = read_text(args.input, "--input", many, bound)
    for where, obj in json_objects(text, lambda n: f"--input {args.input}, line {n}", BadInput,
                                   'an object {"doc": ..., "questions": [...]}'):
        extra = sorted(set(obj) - {"doc", "questions"})
        if extra:
            raise BadInput(f"{where}: unknown key {extra[0]!r} (expected doc and questions)")
        doc, questions = obj.get("doc"), obj.get("questions")
        if not isinstance(doc, str) or not doc.strip():
            raise BadInput(f'{where}: "doc" must be a non-empty string')
        if not isinstance(questions, list) or not questions:
            raise BadInput(f'{where}: "questions" must be a non-empty list of strings')
        for k, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip():
                raise BadInput(f'{where}: question {k + 1} must be a non-empty string')
        try:
            check_jobs([(doc, questions)])  # what the API refuses too: text that is not text
        except BadInput as e:  # "document 1, question 2: ..." is this line's question 2; "document 1: ..." its doc
            said = str(e).removeprefix("document 1, ")
            raise BadInput(f"{where}: " + ('"doc"' + said[len("document 1"):] if said.startswith("document 1")
                                           else said)) from None
        jobs.append((doc, questions))
    if not jobs:
        raise BadInput(f"--input {args.input}: no documents")
    return jobs

"""The generate command's input: a document and its questions from text files, or many documents from JSON Lines.

Both are read whole and checked before anything slow happens: a file that is missing, binary or not UTF-8,
an empty document, no questions, a JSON line that is not a `{"doc": ..., "questions": [...]}` object, or
text that is not text (`checks.check_jobs`) is a `BadInput` naming the file and line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from .checks import check_jobs
from .errors import BadInput


def read_text(path: str, what: str) -> str:
    """A UTF-8 text file (or standard input for '-'), whole, with Windows line endings (\\r\\n) made \\n.
    A leading byte-order mark is dropped."""
    if path == "-" and sys.stdin is None:
        raise BadInput(f"{what} -: standard input is closed")
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{what} {path}: is a directory, not a file") from None
    except OSError as e:
        raise BadInput(f"{what} {path}: cannot read ({e.strerror or e})") from None
    if b"\0" in data:
        raise BadInput(f"{what} {path}: a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        raise BadInput(f"{what} {path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def lines(text: str) -> list[str]:
    """Lines end at \\n only: U+2028, U+0085, form feeds and other characters `str.splitlines` also
    breaks at belong to the line (and are valid inside a JSON string)."""
    return text.split("\n")


def json_objects(text: str, where: Callable[[int], str], error: type[Exception],
                 expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each non-blank line of JSON Lines text; lines end at \\n only (`lines`). A line
    that is not a JSON object raises `error` naming where (`where(line number)`) and what was `expected`."""
    for n, line in enumerate(lines(text), 1):
        if not line.strip():
            continue
        at = where(n)
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise error(f"{at}: not JSON ({e})") from None
        except RecursionError:
            raise error(f"{at}: JSON nested too deeply to read") from None
        if not isinstance(obj, dict):
            raise error(f"{at}: expected {expected}")
        yield at, obj


def read_jobs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(document, questions) pairs from --doc/--questions or --input."""
    if args.input is None:
        doc = read_text(args.doc, "--doc")
        if not doc.strip():
            raise BadInput(f"--doc {args.doc}: the document is empty")
        questions = [q.strip() for q in lines(read_text(args.questions, "--questions")) if q.strip()]
        if not questions:
            raise BadInput(f"--questions {args.questions}: no questions (one per line)")
        return [(doc, questions)]
    jobs = []
    for where, obj in json_objects(read_text(args.input, "--input"), lambda n: f"--input {args.input}, line {n}",
                                   BadInput, 'an object {"doc": ..., "questions": [...]}'):
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
        except BadInput as e:
            raise BadInput(f"{where}: {str(e).split(': ', 1)[-1]}") from None
        jobs.append((doc, questions))
    if not jobs:
        raise BadInput(f"--input {args.input}: no documents")
    return jobs

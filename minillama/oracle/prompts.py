"""The prompts an export runs: token ids from a file (`--prompt-ids`), a document and its questions (`--doc`,
`--questions`), or the built-in example."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..inputs import RepeatedKey, lines, once_each, read_jobs
from ..weights import load_tokenizer

EXAMPLE_DOC = ("The Harbour Bridge in Easton was designed by the engineer Mara Quist and opened in 1932. "
               "It is 503 metres long and carries two railway tracks and a road. Its steel came from the "
               "Lindell works, 40 kilometres up the river.")
EXAMPLE_QUESTIONS = ["Who designed the Harbour Bridge?", "When did the bridge open?", "How long is the bridge?"]


def read_prompts(args: argparse.Namespace, path: Path, config: Any) -> dict[str, Any]:
    """Prompt ids, document of each, question texts and EOS ids, from the arguments: --prompt-ids (a line ends
    at \\n only, as every file the oracle reads), --doc/--questions (read as the command line reads them), or
    the example."""
    if args.prompt_ids:
        if args.doc or args.questions:
            raise BadInput("give --prompt-ids or --doc/--questions, not both")
        prompts, docs = [], []
        try:
            text = lines(Path(args.prompt_ids).read_text(encoding="utf-8"))
        except OSError as e:
            raise BadInput(f"{args.prompt_ids}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise BadInput(f"{args.prompt_ids}: not UTF-8 text (invalid byte at offset {e.start})") from None
        for n, line in enumerate(text, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=once_each)
            except RepeatedKey as e:
                raise BadInput(f"{args.prompt_ids}:{n}: {e}") from None
            except (ValueError, RecursionError):
                obj = None
            unknown = sorted(set(obj) - {"prompt_ids", "doc"}) if isinstance(obj, dict) else []
            if unknown:
                raise BadInput(f"{args.prompt_ids}:{n}: unknown key {unknown[0]!r} (a line holds prompt_ids and doc)")
            ids = obj.get("prompt_ids") if isinstance(obj, dict) else obj
            doc = obj.get("doc", 0) if isinstance(obj, dict) else 0
            if not (isinstance(ids, list) and all(_is_int(i) for i in ids) and _is_int(doc) and doc >= 0):
                raise BadInput(f"{args.prompt_ids}:{n}: expected a JSON list of integer token ids or "
                               '{"prompt_ids": [...], "doc": 0} (doc >= 0)')
            if not ids:
                raise BadInput(f"{args.prompt_ids}:{n}: an empty prompt (no token ids)")
            if min(ids) < 0 or max(ids) >= config.vocab_size:
                raise BadInput(f"{args.prompt_ids}:{n}: token ids must be in 0 .. {config.vocab_size - 1}")
            prompts.append(ids)
            docs.append(doc)
        if not prompts:
            raise BadInput(f"{args.prompt_ids}: no prompts")
        return {"prompts": prompts, "docs": docs, "questions": None, "eos_ids": None}
    if bool(args.doc) != bool(args.questions):
        raise BadInput("--doc and --questions go together")
    if args.doc:  # read and checked as the command line reads them (a line ends at "\n" only, ...)
        ((doc, questions),) = read_jobs(argparse.Namespace(input=None, doc=args.doc, questions=args.questions),
                                        config.context)
    else:
        doc, questions = EXAMPLE_DOC, EXAMPLE_QUESTIONS
    from ..api import build_prompts

    tok = load_tokenizer(path)
    prompts, docs, _ = build_prompts(tok, [(doc, questions)])
    eos = list(dict.fromkeys([*tok.eos_ids, *config.eos_token_ids]))
    return {"prompts": prompts, "docs": docs, "questions": questions, "eos_ids": eos}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

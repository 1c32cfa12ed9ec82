"""Records: what a run answered, step by step, in a file another backend can be checked against.

A record holds, per question, the prompt's token ids, the generated ids, and (when known) the raw logits
row and the log-probability of every generated token; a reference record may also hold the hidden states
of every layer. One safetensors file holds it all:

    q{i}.token_ids   (steps,)            int64    generated ids, the stop token included
    q{i}.logits      (steps, vocab)      float32  raw logits at each step (before sampling)
    q{i}.logprobs    (steps,)            float32  log-softmax of the logits at each chosen token
    q{i}.prompt_ids  (prompt,)           int64    the question's complete stand-alone prompt
    q{i}.hidden      (layers+1, T, hidden) float32  embeddings and each block's output over the prompt and
                                                  the answer but its last token (export --hidden)

Only `q{i}.token_ids` is required: a backend writes what it has. The manifest (JSON) rides in the file's
metadata under "minillama-oracle" and is also written beside it as `<name>.json`: model, sampling, dtype,
device, library versions, the minillama commit, and per question its prompt ids and answer.

A candidate can also come as JSON Lines, one object per question, in order:
    {"token_ids": [...], "logprobs": [...], "logits": [[...], ...], "prompt_ids": [...]}
with only "token_ids" required.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import torch

from ..files import json_text, utf8_name, write_file
from ..generate import Answer, SamplingParams, generate, shared_prefix_length
from ..inputs import json_objects
from ..model import Llama
from .backends import MinillamaBackend
from .schema import QuestionRecord, Record, RecordError, is_number

FORMAT = "minillama-oracle/1"
META_KEY = "minillama-oracle"
JSONL_KEYS = {"token_ids", "logprobs", "logits", "prompt_ids"}
MAX_DEPTH = 100  # levels of nesting a manifest may have


# --------------------------------------------------------------------------------------------------
# Making a reference record


def export(model: Llama, prompts: Sequence[Sequence[int]], *, docs: Sequence[int] | None = None,
           max_new_tokens: int = 16, mode: str = "parallel", eos_ids: Sequence[int] | None = None,
           hidden: bool = False, questions: Sequence[str] | None = None,
           model_path: str | None = None) -> Record:
    """Answer `prompts` greedily with minillama, keeping every step's logits (and hidden states)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, keep_logits=True)
    answers = generate(model, prompts, params, mode=mode, docs=docs, eos_ids=eos_ids)
    docs = list(docs) if docs is not None else [0] * len(prompts)
    # The document segment of each document, as generate() cuts it in parallel mode.
    shared = {d: shared_prefix_length([p for p, dd in zip(prompts, docs) if dd == d]) for d in set(docs)}
    vocab = model.config.vocab_size
    out = [_question(p, a, vocab, shared[d], d, questions[i] if questions is not None else None)
           for i, (p, a, d) in enumerate(zip(prompts, answers, docs))]
    backend = MinillamaBackend(model)
    if hidden:
        blocks = ["embed"] + [f"layers.{i}" for i in range(model.config.num_hidden_layers)]
        for q in out:
            acts = backend.activations(q.prompt_ids + q.token_ids[:-1]).tensors
            q.hidden = torch.stack([acts[b] for b in blocks])
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": model_path, "config": model.config.to_dict()},
        "backend": backend.describe(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "mode": mode,
        "sampling": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                     "eos_ids": None if eos_ids is None else list(eos_ids)},
        "versions": versions(),
        "minillama_commit": git_commit(),
        "hidden_states": "embeddings, then each block's output" if hidden else None,
    }
    return Record(out, manifest)


def _question(prompt: Sequence[int], a: Answer, vocab: int, shared: int, doc: int,
              text: str | None) -> QuestionRecord:
    logits = torch.stack(a.logits).float() if a.logits else torch.zeros(0, vocab)
    return QuestionRecord(list(prompt), list(a.token_ids), logits, torch.tensor(a.logprobs, dtype=torch.float32),
                          shared=shared, doc=doc, question=text, finish_reason=a.finish_reason)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("minillama", "torch", "numpy", "safetensors", "tokenizers", "gguf", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> str | None:
    """The commit of the minillama checkout this code runs from, "+dirty" with uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


# --------------------------------------------------------------------------------------------------
# Files


def manifest_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def check_manifest_free(path: str | Path) -> None:
    """RecordError where the manifest of a record written to `path` would replace a file that is not an
    earlier record's manifest (the user named the .safetensors file, not this one)."""
    m = manifest_path(path)
    if not m.is_file():
        return
    try:
        ours = json.loads(m.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, RecursionError, AttributeError):
        ours = False
    if not ours:
        raise RecordError(f"{m}: exists and is not a record's manifest, which export writes there; move it or "
                          "choose another --output")


def save(record: Record, path: str | Path) -> Path:
    """Write `path` (safetensors) and the manifest beside it; returns the manifest's path."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for i, q in enumerate(record.questions):
        tensors[f"q{i}.token_ids"] = torch.tensor(q.token_ids, dtype=torch.int64)
        if q.prompt_ids is not None:
            tensors[f"q{i}.prompt_ids"] = torch.tensor(q.prompt_ids, dtype=torch.int64)
        for name in ("logits", "logprobs", "hidden"):
            t = getattr(q, name)
            if t is not None:
                tensors[f"q{i}.{name}"] = t.float().contiguous()
    manifest = dict(record.manifest)
    manifest["questions"] = [
        {"prompt_ids": q.prompt_ids, "token_ids": q.token_ids, "finish_reason": q.finish_reason,
         "doc": q.doc, "shared": q.shared, "question": q.question} for q in record.questions]
    text = _manifest_text(manifest)
    # Each write alone is atomic (write_file: a temporary, then a rename). The record's tensors go to its
    # temporary first, the slow part; then the manifest replaces its old one, then the record its: a run
    # killed before that leaves the old pair, not a new manifest beside an old record. A manifest that cannot
    # be written leaves the record as it was; a record that cannot be renamed puts the old manifest back.
    mpath = manifest_path(path)
    try:
        old = mpath.read_bytes() if mpath.is_file() else None
    except OSError:
        old = None
    written = False

    def tensors_then_manifest(f: Path) -> None:
        nonlocal written
        save_file(tensors, str(f), metadata={META_KEY: json_text(manifest)})
        write_file(mpath, text + "\n")
        written = True

    try:
        write_file(path, tensors_then_manifest)
    except BaseException:
        if written:
            write_file(mpath, old) if old is not None else mpath.unlink(missing_ok=True)
        raise
    return mpath


def load(path: str | Path) -> Record:
    """A record from a safetensors file or a JSON Lines candidate file."""
    p = Path(path)
    if not p.is_file():
        raise RecordError(f"{p}: " + ("is a folder" if p.is_dir() else "not a regular file (a pipe or a device): "
                                      "give a file" if p.exists() else "no such file"))
    if p.suffix.lower() in (".jsonl", ".json"):
        return _load_jsonl(p)
    return _load_safetensors(p)


def _load_safetensors(p: Path) -> Record:
    from safetensors import safe_open

    try:
        with utf8_name(p) as name, safe_open(name, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers
        with open(p, "rb") as f:
            text = f.read(1) == b"{"
        raise RecordError(f"{p}: not a readable safetensors file ({e})"
                          + ("; a JSON Lines candidate is read as one when named .jsonl" if text else "")) from None
    try:
        manifest = json.loads(meta[META_KEY]) if META_KEY in meta else {}
    except (ValueError, RecursionError):
        raise RecordError(f"{p}: its {META_KEY} metadata is not readable JSON") from None
    if not isinstance(manifest, dict):
        raise RecordError(f"{p}: its {META_KEY} metadata is not a JSON object")
    if _depth(manifest) > MAX_DEPTH:  # the report and --json walk it: past Python's stack, a traceback
        raise RecordError(f"{p}: its {META_KEY} metadata is nested more than {MAX_DEPTH} levels deep")
    if manifest.get("format", FORMAT) != FORMAT:
        raise RecordError(f"{p}: its manifest's format is {json.dumps(manifest['format'])[:40]}; this minillama "
                          f"reads {FORMAT}")
    described = _manifest_parts(manifest, p)
    count = 0
    while f"q{count}.token_ids" in tensors:
        count += 1
    if described and len(described) != count:
        raise RecordError(f"{p}: its manifest describes {len(described)} questions, its tensors hold {count}")
    if count == 0:
        raise RecordError(f"{p}: no q0.token_ids tensor (see `python -m minillama.oracle --help` for the layout)")
    known = {f"q{i}.{k}" for i in range(count) for k in ("token_ids", "prompt_ids", "logits", "logprobs", "hidden")}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise RecordError(f"{p}: unknown tensor {unknown[0]!r} (expected q<i>.token_ids, .logits, .logprobs, "
                          f".prompt_ids, .hidden for questions 0 .. {count - 1})")
    for name, t in tensors.items():
        if name.endswith(("token_ids", "prompt_ids")) and (t.dtype.is_floating_point or t.dtype.is_complex
                                                            or t.dtype == torch.bool or t.dim() != 1):
            raise RecordError(f"{p}: {name} must be a 1-D integer tensor; got {t.dtype} {tuple(t.shape)}")
    questions = []
    for i in range(count):
        d = described[i] if i < len(described) else {}
        if d.get("prompt_ids") is not None:
            _ints(d["prompt_ids"], "prompt_ids", f"{p}: the manifest's question {i + 1}")
        prompt = tensors.get(f"q{i}.prompt_ids")
        q = QuestionRecord(
            prompt_ids=prompt.tolist() if prompt is not None else d.get("prompt_ids"),
            token_ids=tensors[f"q{i}.token_ids"].tolist(),
            logits=_float(tensors.get(f"q{i}.logits")), logprobs=_float(tensors.get(f"q{i}.logprobs")),
            hidden=_float(tensors.get(f"q{i}.hidden")), shared=d.get("shared", 0), doc=d.get("doc", 0),
            question=d.get("question"), finish_reason=d.get("finish_reason"))
        q.check(f"{p}: question {i + 1}")
        for key in ("prompt_ids", "token_ids"):  # the manifest is what another backend reads: it must agree
            if d.get(key) is not None and d[key] != getattr(q, key):
                raise RecordError(f"{p}: the manifest's question {i + 1}: {key} differ from the tensor q{i}.{key}")
        questions.append(q)
    manifest.pop("questions", None)
    return Record(questions, manifest)


def _depth(x: Any) -> int:
    """How deep JSON data nests (a scalar: 0), counted without recursion."""
    deepest, todo = 0, [(x, 0)]
    while todo:
        x, d = todo.pop()
        deepest = max(deepest, d)
        if isinstance(x, (dict, list)) and d < MAX_DEPTH + 1:
            todo.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _manifest_parts(manifest: dict, p: Path) -> list[dict]:
    """The manifest's questions, checked with its model: what the tools read of them has the types they read."""
    described = manifest.get("questions", [])
    described = [] if described is None else described
    if not (isinstance(described, list) and all(isinstance(d, dict) for d in described)):
        raise RecordError(f"{p}: its manifest's questions must be a list of objects")
    for i, d in enumerate(described, 1):
        if not all(isinstance(d.get(k, 0), int) and not isinstance(d.get(k, 0), bool) for k in ("doc", "shared")):
            raise RecordError(f"{p}: the manifest's question {i}: doc and shared must be integers")
    model = manifest.get("model")
    if model is not None and not (isinstance(model, dict) and isinstance(model.get("path"), (str, type(None)))):
        raise RecordError(f"{p}: its manifest's model must be an object whose path is a string")
    for key in ("backend", "mode", "minillama_commit", "dtype", "device", "describe"):
        if not isinstance(manifest.get(key), (str, type(None))):
            raise RecordError(f"{p}: its manifest's {key} must be a string; got {json.dumps(manifest[key])[:40]}")
    versions = manifest.get("versions", {})
    if not (isinstance(versions, dict) and all(isinstance(v, (str, type(None))) for v in versions.values())):
        raise RecordError(f"{p}: its manifest's versions must be an object of version strings")
    return described


def bos_id(rec: Record) -> int | None:
    """The BOS id of the model that made `rec`, as its manifest's config names it; None where it names none."""
    config = (rec.manifest.get("model") or {}).get("config")
    bos = config.get("bos_token_id") if isinstance(config, dict) else None
    return bos if type(bos) is int else None


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _load_jsonl(p: Path) -> Record:
    questions = []
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{p}: not a readable UTF-8 text file ({e})") from None
    try:  # export's manifest, given where its record goes
        ours = json.loads(text).get("format") == FORMAT
    except (ValueError, RecursionError, AttributeError):
        ours = False
    if ours:
        raise RecordError(f"{p}: a record's manifest, not a record; give {p.with_suffix('.safetensors')}")
    for where, obj in json_objects(text, lambda n: f"{p}:{n}", RecordError, "an object with token_ids"):
        unknown = sorted(set(obj) - JSONL_KEYS)
        if unknown:
            raise RecordError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(sorted(JSONL_KEYS))})")
        if "token_ids" not in obj:
            raise RecordError(f"{where}: token_ids is missing")
        q = QuestionRecord(
            prompt_ids=_ints(obj["prompt_ids"], "prompt_ids", where) if obj.get("prompt_ids") is not None else None,
            token_ids=_ints(obj["token_ids"], "token_ids", where),
            logits=_floats(obj["logits"], "logits", where, rows=True) if obj.get("logits") is not None else None,
            logprobs=_floats(obj["logprobs"], "logprobs", where) if obj.get("logprobs") is not None else None)
        q.check(where)
        questions.append(q)
    if not questions:
        raise RecordError(f"{p}: no questions (one JSON object per line)")
    return Record(questions)


def _ints(x: Any, key: str, where: str) -> list[int]:
    """A JSON list of integers, exactly: 504.0, 504.9, "504" and true are refused, not converted."""
    if not isinstance(x, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        bad = next((t for t in x if not (isinstance(t, int) and not isinstance(t, bool))), x) \
            if isinstance(x, list) else x
        raise RecordError(f"{where}: {key} must be a list of integers; got {json.dumps(bad)[:40]}")
    return x


def _floats(x: Any, key: str, where: str, rows: bool = False) -> torch.Tensor:
    """A JSON list of numbers (rows=True: a list of equally long lists of numbers) as float32."""
    shape = "a list of lists of numbers, one per token id" if rows else "a list of numbers, one per token id"
    ok = isinstance(x, list) and (all(isinstance(r, list) and all(is_number(v) for v in r) for r in x) if rows
                                  else all(is_number(v) for v in x))
    if not ok or (rows and len({len(r) for r in x}) > 1):
        raise RecordError(f"{where}: {key} must be {shape}")
    return torch.tensor(x, dtype=torch.float32) if x else torch.zeros((0, 0) if rows else (0,))


def _manifest_text(x: Any, level: int = 0) -> str:
    """The manifest's JSON indented for reading, one space a level, but each list of integers (token ids) on
    one line: built so, as a rewrite of the text would reach into the strings (a question's "[1,2]")."""
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(x, dict) and x:
        items = [f"{inner}{json_text(str(k))}: {_manifest_text(v, level + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(x, (list, tuple)) and x and not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return "[\n" + ",\n".join(inner + _manifest_text(v, level + 1) for v in x) + f"\n{pad}]"
    return json_text(x)

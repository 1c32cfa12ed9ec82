"""`python -m minillama.oracle`: export a reference run, compare a candidate with it.

    python -m minillama.oracle export -o ref.safetensors [--doc DOC --questions QUESTIONS] [--hidden]
    python -m minillama.oracle compare --backend transformers [--layers] [--json]
    python -m minillama.oracle compare --backend llama-cpp --backend-model model.gguf
    python -m minillama.oracle compare --backend openai --url http://127.0.0.1:8000/v1
    python -m minillama.oracle compare --reference ref.safetensors --candidate answers.jsonl
    python -m minillama.oracle load --url http://127.0.0.1:8000/v1 [--requests 200 --clients 16] [--json F]

Without --doc/--questions or --prompt-ids, a small built-in document with three questions is used.
Exit status: 0 when every question passes; 1 when one fails; 2 on bad input (one line on stderr).
`load` (under_load.py): 0 when every answer is identical, 3 when some differ, 1 when all are identical but
--reference-model's comparison fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import distributed
from ..errors import BadInput, OneLineParser, check_device, run_command, say_at_terminal
from ..files import json_text, write_file
from ..generate import MODES
from ..precision import DTYPES
from ..weights import build_model, default_model_dir, fetch_default, load_model_part, load_state_dict, load_tokenizer
from .backends import BACKENDS, LlamaCppBackend, MinillamaBackend, load_backend
from .diff import Comparison, compare, diff_hidden, run_backend
from .layers import diff_layers
from .report import report
from .tolerances import BACKEND_PRESETS, PRESETS, Tolerances
from .server import OpenAIBackend, base_url, seconds
from .prompts import EXAMPLE_DOC, EXAMPLE_QUESTIONS, read_prompts  # noqa: F401 (the tests read the example)
from .record import Record, bos_id, check_manifest_free, export, load, save

# The reference's options with a default: given with a --reference (or beside two files) they would change nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a folder with neither holds weights alone
MODEL_DEFAULTS = {"device": "cpu", "dtype": "float32", "max_new_tokens": 16, "mode": "parallel"}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillama.oracle", allow_abbrev=False,
                description="minillama as a correctness oracle: export its greedy answers with every step's "
                            "logits, and compare another backend or a candidate file with them.",
                epilog="Exit status: 0 when every question passes, 1 when one fails, 2 on bad input; load: 3 when "
                       "some answers differ.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser, metavar="{export,compare,load}")
    e = sub.add_parser("export", help="answer greedily with minillama; write tokens and logits (safetensors + JSON)")
    c = sub.add_parser("compare", help="compare a backend (run on the reference's tokens) or a candidate file")
    for s in (e, c):
        m = s.add_argument_group("reference model and prompts")
        m.add_argument("--model", "-m", metavar="PATH",
                       help="HF or Meta directory, or .gguf file (default: the default model, SmolLM2-135M-Instruct)")
        m.add_argument("--device", default=MODEL_DEFAULTS["device"], help="torch device (default: cpu)")
        m.add_argument("--dtype", default=MODEL_DEFAULTS["dtype"], choices=DTYPES, help="default: float32")
        m.add_argument("--doc", metavar="DOC", help="the document: a UTF-8 text file (with --questions)")
        m.add_argument("--questions", metavar="QUESTIONS", help="one question per line")
        m.add_argument("--prompt-ids", metavar="FILE.jsonl",
                       help='prompts as token ids, one JSON list per line (or {"prompt_ids": [...], "doc": 0}); '
                            "prompts of one doc share their common prefix")
        m.add_argument("--max-new-tokens", "-n", type=int, default=MODEL_DEFAULTS["max_new_tokens"], metavar="N",
                       help="default: 16")
        m.add_argument("--mode", default=MODEL_DEFAULTS["mode"], choices=[x for x in MODES if x != "seqbatch"],
                       help="how minillama schedules the questions; the bits are the same (default: parallel)")
    e.add_argument("--output", "-o", required=True, metavar="OUT.safetensors",
                   help="the record; the manifest goes to OUT.json beside it")
    e.add_argument("--hidden", action="store_true", help="also every layer's hidden states (embeddings + blocks)")
    distributed.add_options(e, procs=False)  # under torchrun: the reference model sharded (--tp)
    src = c.add_argument_group("what to compare")
    src.add_argument("--reference", metavar="REF.safetensors",
                     help="a record from `export` (default: run minillama now on --model and the prompts)")
    src.add_argument("--backend", choices=list(BACKENDS),
                     help="run this backend on the reference's prompts and answers (teacher forcing)")
    src.add_argument("--backend-model", metavar="PATH",
                     help="what the backend runs: transformers, an HF directory or a .gguf file (read by "
                          "transformers' own GGUF reader; default: the reference's model); llama-cpp, a .gguf "
                          "file; openai, the server's model name (default: the first it lists)")
    src.add_argument("--url", metavar="URL", help="openai backend: the server's base URL, e.g. http://127.0.0.1:8000/v1")
    src.add_argument("--kv-cache", choices=["f16", "f32"],
                     help="llama-cpp backend: the KV cache type (default: llama.cpp's, F16)")
    src.add_argument("--candidate", metavar="FILE",
                     help="a candidate's answers: .safetensors (export's layout) or .jsonl, one object per "
                          'question: {"token_ids": [...], "logprobs": [...], "logits": [[...]]}')
    src.add_argument("--layers", action="store_true",
                     help="also compare layer by layer and name the first sub-module out of tolerance (with "
                          "--backend: both models run again; with --candidate: the hidden states both files hold)")
    t = c.add_argument_group("tolerances (elementwise: |cand - ref| <= atol + rtol * |ref|)")
    t.add_argument("--preset", choices=list(PRESETS),
                   help="; ".join(f"{k}: logits {v.atol:g}+{v.rtol:g}*|ref|, logprobs {v.logprob_atol:g}+"
                                  f"{v.logprob_rtol:g}*|ref|" for k, v in PRESETS.items())
                        + ". Default by backend: " + ", ".join(f"{k} {v}" for k, v in BACKEND_PRESETS.items())
                        + "; candidate files fp32 (exact when minillama wrote them); the options below change "
                          "one value of it")
    t.add_argument("--atol", type=float, help="logits")
    t.add_argument("--rtol", type=float, help="logits")
    t.add_argument("--logprob-atol", type=float)
    t.add_argument("--logprob-rtol", type=float)
    t.add_argument("--layer-rtol", type=float, help="activations: max|err| <= this * max|ref|")
    t.add_argument("--top-k", type=int, default=5, help="top-k overlap reported (default: 5)")
    c.add_argument("--allow-prefix", action="store_true",
                   help="a candidate answer shorter than the reference's passes on the steps it has "
                        "(default: it fails)")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    ld = sub.add_parser("load", help="does a server give each request the same answer under load, again, cold "
                                     "and streamed as alone? (exit 3 when some differ)")
    ld.add_argument("--url", required=True, metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    ld.add_argument("--model", metavar="NAME", help="the served model's name (default: the first /v1/models lists)")
    ld.add_argument("--requests", type=int, default=200, metavar="N", help="probe requests (default: 200)")
    ld.add_argument("--clients", type=int, default=16, metavar="C", help="concurrent clients under load (default: 16)")
    ld.add_argument("--seed", type=int, default=0, metavar="S", help="the random workload's seed (default: 0)")
    ld.add_argument("--max-tokens", type=int, default=16, metavar="N",
                    help="a probe asks for 1 to N new tokens (default: 16)")
    ld.add_argument("--prompts", choices=["auto", "ids", "text"], default="auto",
                    help="token-id prompts where the server takes them, else text (auto, the default), or one kind")
    ld.add_argument("--json", metavar="FILE", help="also write the result, every differing request included, as JSON")
    ld.add_argument("--reference-model", metavar="PATH",
                    help="also check the server against minillama on this checkpoint: `compare --backend openai` "
                         "(teacher-forced on minillama's answers, preset fp32) on the greedy probes' prompts")
    ld.add_argument("--device", default="cpu", help="torch device of --reference-model (default: cpu)")
    ld.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of --reference-model (default: float32)")
    for sub_parser, wait, only in ((c, 120, "--backend openai; "), (ld, 600, "")):  # a hung server is named after this
        sub_parser.add_argument("--timeout", type=seconds, default=wait, metavar="S", help="seconds to wait for a "
                                f"server's answer to one request ({only}default: {wait})")
    return p


# --------------------------------------------------------------------------------------------------
# Reference


def _model_path(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else fetch_default()


def _load_reference_model(path: Path, args: argparse.Namespace, device: str | None = None, shard=None,
                          dtype: str | None = None):
    """The reference model, in `dtype` (default --dtype); with `shard` (a tensor-parallel rank's), only the rank's
    parts are read."""
    if shard is not None:
        return load_model_part(path, device or args.device, DTYPES[dtype or args.dtype], shard)
    config, sd = load_state_dict(path)
    return build_model(config, sd, device or args.device, DTYPES[dtype or args.dtype])


def _dtype_of(ref: Record) -> str | None:
    """The dtype a record was made in, for --layers' reference model: the layers of the run whose logits are
    compared (--dtype is the backend's); None where the record does not say."""
    made = ref.manifest.get("dtype")
    if made is not None and made not in DTYPES:
        raise BadInput(f"--layers: the reference was made in {made}, which minillama does not build "
                       f"({', '.join(DTYPES)})")
    return made


def _make_reference(args: argparse.Namespace, hidden: bool = False):
    if args.max_new_tokens < 1:
        raise BadInput("--max-new-tokens must be at least 1")
    path = _model_path(args)
    here = None
    if args.cmd == "export":
        from ..distributed import parallel

        distributed.check_options(args)
        here = parallel.join(args)
    model = _load_reference_model(path, args, here and parallel.load_device(args, here),
                                  here and parallel.sharding(args, here))
    if here is not None:
        parallel.place(model, args, here)
    p = read_prompts(args, path, model.config)
    context = model.config.context
    for i, ids in enumerate(p["prompts"], 1):
        if len(ids) + args.max_new_tokens > context:
            raise BadInput(f"prompt {i}: {len(ids)} tokens + {args.max_new_tokens} new ones exceed the model's "
                           f"context ({context})")
    rec = export(model, p["prompts"], docs=p["docs"], max_new_tokens=args.max_new_tokens, mode=args.mode,
                 eos_ids=p["eos_ids"], hidden=hidden, questions=p["questions"], model_path=str(path))
    if here is not None:
        rec.manifest.update(here.summary())  # ranks, tp and units, when they are not one process's defaults
        if not here.leave():
            return None, model  # every rank holds the same record; rank 0 writes it
    return rec, model


def _describe_reference(rec: Record) -> str:
    m = rec.manifest
    parts = [m.get("backend") or "minillama", f"{m.get('mode') or '?'} mode, greedy"]  # null in a manifest
    if (m.get("model") or {}).get("path"):
        parts.append(m["model"]["path"])
    if m.get("minillama_commit"):
        parts.append(f"commit {m['minillama_commit'][:12]}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------------
# Commands


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.suffix != ".safetensors":
        raise BadInput(f"{out}: the record is a .safetensors file")
    _check_writable(out, out.with_suffix(".json"))  # before the model runs, not after
    check_manifest_free(out)
    _check_not_an_input(out, args)
    rec, _ = _make_reference(args, hidden=args.hidden)
    if rec is None:
        return 0
    mpath = save(rec, out)
    for i, q in enumerate(rec.questions):
        print(f"q{i + 1}: {len(q.prompt_ids)} prompt tokens -> {len(q.token_ids)} tokens ({q.finish_reason}): "
              f"{q.token_ids}")
    print(f"wrote {out} and {mpath}")
    return 0


def _check_writable(out: Path, *beside: Path) -> None:
    """`out` (and the files written `beside` it) can be written: a folder that is there and takes files."""
    parent = out.parent
    if not parent.is_dir():
        raise BadInput(f"{out}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise BadInput(f"{out}: the folder {parent} is not writable")
    for f in (out, *beside):
        if f.is_dir():
            raise BadInput(f"{f}: is a folder")
        if f.is_symlink() and not Path(os.path.realpath(f)).parent.is_dir():
            raise BadInput(f"{f}: a link to {os.readlink(f)}, whose folder does not exist")
    try:  # where the folder says it is writable and is not (/proc, a read-only mount): a file made and gone
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise BadInput(f"{out}: cannot write in {parent} ({e.strerror})") from None


def _check_not_an_input(out: Path, args: argparse.Namespace) -> None:
    """The record and its manifest are written over none of the files the export reads: the prompts, the
    model's file, or a file of its folder (its weights, config or tokenizer)."""
    model = Path(args.model or default_model_dir()).resolve()  # no --model: the default model's folder
    named = args.model or f"(default) {default_model_dir()}"
    for f in (out, out.with_suffix(".json")):
        here = f.resolve()
        if model == here or (model == here.parent and here.exists()):
            raise BadInput(f"{f}: would be written over {'' if model == here else 'a file of '}--model {named}; "
                           "write the record elsewhere")
        for name in ("prompt_ids", "doc", "questions"):
            given = getattr(args, name)
            if given and given != "-" and Path(given).resolve() == here:
                raise BadInput(f"{f}: would be written over --{name.replace('_', '-')} {given}; write the record "
                               "elsewhere")


def _tolerances(args: argparse.Namespace, default: str) -> Tolerances:
    """The preset (--preset, or the default for what is compared) with the values given one by one."""
    base = PRESETS[args.preset or default]
    names = ("atol", "rtol", "logprob_atol", "logprob_rtol", "layer_rtol")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    values = {**{k: getattr(base, k) for k in names}, **given}
    if bad := [k for k, v in given.items() if not v >= 0]:  # NaN is not >= 0
        raise BadInput(f"tolerances must be >= 0: --{bad[0].replace('_', '-')} {given[bad[0]]}")
    if args.top_k < 1:
        raise BadInput(f"--top-k must be >= 1, got {args.top_k}")
    changed = [k for k, v in given.items() if v != getattr(base, k)]
    name = base.preset + (f" with {', '.join('--' + k.replace('_', '-') for k in changed)} set" if changed else "")
    return Tolerances(**values, top_k=args.top_k, preset=name)


def _openai_backend(args: argparse.Namespace, ref_path: str | None, ref: Record) -> OpenAIBackend:
    """The server's backend; the reference's config names the BOS a server may leave out of its echo."""
    if not args.url:
        raise BadInput("--backend openai needs --url (the server's base URL, e.g. http://127.0.0.1:8000/v1)")
    url, decode, vocab = base_url(args.url), None, None
    at = Path(ref_path) if ref_path is not None else None  # a folder of weights alone: top-k asked by id only
    if at is not None and at.exists() and (not at.is_dir() or any((at / f).exists() for f in TOKENIZER_FILES)):
        tok = load_tokenizer(at)  # the server's top-k come as texts: map them back to ids
        decode = tok.decode
        vocab = [tok.decode([i]) for i in range(tok.vocab_size)]
    return OpenAIBackend(url, args.backend_model, args.top_k, args.timeout, decode=decode, vocab=vocab,
                         bos=bos_id(ref))


def _nothing_ignored(args: argparse.Namespace) -> None:
    """Refuse the reference model's options where nothing would read them: a --reference holds its answers
    (their length and mode); a --candidate beside it runs no model at all; the llama-cpp and openai backends
    choose their own device and dtype, and run no reference model (they give no --layers)."""
    if not args.reference:
        return
    fixed, why = ["max_new_tokens", "mode"], ""
    if args.candidate:
        fixed, why = fixed + ["model", "device", "dtype"], " and --candidate runs no model"
    elif args.backend in ("llama-cpp", "openai"):
        fixed, why = fixed + ["device", "dtype"], f" and the {args.backend} backend chooses its own device and dtype"
    said = getattr(args, "options_given", set())  # -n 16 is refused as -n 4 is, though 16 is the default
    if given := [k for k in fixed if k in said or getattr(args, k) != MODEL_DEFAULTS.get(k)]:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise BadInput(f"{flags}: --reference already holds the answers{why}; drop {flags}")


def cmd_compare(args: argparse.Namespace) -> int:
    if bool(args.backend) == bool(args.candidate):
        raise BadInput("give one of --backend or --candidate")
    if args.layers and args.backend and not BACKENDS[args.backend].supports_activations:
        raise BadInput(f"--layers: the {args.backend} backend gives no layer-by-layer activations")
    timeout = args.timeout != 120 or "timeout" in getattr(args, "options_given", ())
    if (args.url or timeout) and args.backend != "openai":
        raise BadInput("--url and --timeout go with --backend openai")
    if args.url:
        base_url(args.url)  # before any reference is made
    if args.kv_cache and args.backend != "llama-cpp":
        raise BadInput("--kv-cache goes with --backend llama-cpp")
    if args.backend_model and not args.backend:
        raise BadInput("--backend-model goes with --backend")
    _nothing_ignored(args)
    if args.model and not Path(args.model).exists():  # else, beside a --reference, passed over in silence
        raise BadInput(f"--model {args.model}: no such file or directory")
    tol = _tolerances(args, BACKEND_PRESETS[args.backend] if args.backend else "fp32")
    model, made_in = None, None
    if args.reference:
        if args.doc or args.questions or args.prompt_ids:
            raise BadInput("--reference already holds the prompts; drop --doc/--questions/--prompt-ids")
        ref = load(args.reference)
        made_in = _dtype_of(ref) if args.layers and args.backend else None  # before the backend runs
    else:
        ref, model = _make_reference(args)
    ref_path = args.model or (ref.manifest.get("model") or {}).get("path")
    if args.backend == "openai":
        backend = _openai_backend(args, ref_path, ref)
        cand = run_backend(ref, backend)
    elif args.backend:
        backend_path = args.backend_model or ref_path
        if backend_path is None:
            raise BadInput("the reference names no model; give --backend-model")
        if args.backend == "llama-cpp":
            # Its logits buffer is context x vocabulary floats: size the context to the longest question.
            longest = max(len(q.prompt_ids or []) + len(q.token_ids) for q in ref.questions)
            backend = LlamaCppBackend(backend_path, n_ctx=max(256, longest + 16), kv_type=args.kv_cache)
        else:
            backend = load_backend(args.backend, backend_path, args.device, DTYPES[args.dtype])
        cand = run_backend(ref, backend)
    else:
        cand = load(args.candidate)
        made_by = cand.manifest.get("backend")
        cand.manifest["describe"] = f"{args.candidate} ({made_by})" if made_by else args.candidate
        if args.preset is None and str(made_by).startswith("minillama") and _same_setup(ref, cand):
            tol = _tolerances(args, "exact")
    if args.layers and args.candidate:  # a layer diff from files: both must hold hidden states
        bare = [n for n, rec in (("reference", ref), ("candidate", cand)) if all(q.hidden is None for q in rec.questions)]
        if bare:
            raise BadInput(f"--layers: the {' and the '.join(bare)} hold{'s' * (len(bare) == 1)} no hidden states "
                           "(export with --hidden)")
    results = compare(ref, cand, tol, allow_prefix=args.allow_prefix)
    if args.layers and args.candidate:
        for r, d in zip(results, diff_hidden(ref, cand, tol)):
            r.layers = d
            if d is None:  # said, not skipped in silence: the other questions' layers were compared
                r.notes.append("no layer diff: a file holds no hidden states (or no prompt ids) for this question")
    elif args.layers:
        if model is None:
            if ref_path is None:
                raise BadInput("the reference names no model; give --model for --layers")
            model = _load_reference_model(Path(ref_path), args, dtype=made_in)
        for r, d in zip(results, diff_layers(ref, MinillamaBackend(model), backend, tol)):
            r.layers = d
    c = Comparison({"describe": _describe_reference(ref), **{k: v for k, v in ref.manifest.items()
                                                           if k in ("model", "versions", "minillama_commit")}},
                   {"describe": cand.manifest.get("describe", "")}, tol, results)
    print(json_text(c.to_json(), indent=1) if args.json else report(c))
    return 0 if c.passed else 1


def _same_setup(ref: Record, cand: Record) -> bool:
    """Two minillama records made alike (dtype, device, torch, product units: an export at other --units than
    the default names them): they must hold the same bits."""
    keys = ("dtype", "device", "units")
    return (all(ref.manifest.get(k) == cand.manifest.get(k) for k in keys)
            and (ref.manifest.get("versions") or {}).get("torch") == (cand.manifest.get("versions") or {}).get("torch"))


def cmd_load(args: argparse.Namespace) -> int:
    """The load check (under_load.py); with --reference-model, `compare --backend openai` on its greedy probes."""
    from . import under_load as loadcheck

    if args.json:
        _check_writable(Path(args.json))
    if args.reference_model and not Path(args.reference_model).exists():
        raise BadInput(f"--reference-model {args.reference_model}: no such file or directory")
    reference = None  # read before the run, which may take minutes, not after it
    if args.reference_model:
        reference = _load_reference_model(Path(args.reference_model), args), load_tokenizer(Path(args.reference_model))
    result = loadcheck.run(args.url, args.model, args.requests, args.clients, args.seed, args.max_tokens,
                           args.prompts, args.timeout, say_at_terminal)
    text, passed, refused = loadcheck.report(result), True, None
    if reference is not None:
        try:
            c = _reference_of_load(args, result, *reference)
            result["reference"] = c.to_json()
            text, passed = text + "\n\nminillama's reference, on the greedy probes:\n" + report(c), c.passed
        except BadInput as e:  # the run's own report is kept, then the reason given
            refused = e
    print(text)
    if args.json:
        write_file(args.json, json_text(result, indent=1) + "\n")
    if refused is not None:
        raise refused
    return 3 if not result["identical"] else 0 if passed else 1


def _reference_of_load(args: argparse.Namespace, result: dict[str, Any], model: Any, tok: Any) -> Comparison:
    path = Path(args.reference_model)
    prompts = [p["prompt"] if isinstance(p["prompt"], list) else tok.encode(p["prompt"], add_special=True,
                                                                            parse_special=False)
               for p in result["probes"] if p["temperature"] == 0]
    if not prompts:
        raise BadInput("no greedy probe to compare with minillama's reference: raise --requests")
    eos = list(dict.fromkeys([*tok.eos_ids, *model.config.eos_token_ids]))
    ref = export(model, prompts, max_new_tokens=args.max_tokens, mode="independent", eos_ids=eos,
                 model_path=str(path))
    args.backend_model, args.top_k = result["server"]["model"], 5
    cand = run_backend(ref, _openai_backend(args, str(path), ref))
    tol = PRESETS[BACKEND_PRESETS["openai"]]
    return Comparison({"describe": _describe_reference(ref)}, {"describe": cand.manifest.get("describe", "")}, tol,
                      compare(ref, cand, tol))


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status (`errors.run_command`): 0 every question passes, 1 one fails, 2 bad input or a file
    that cannot be written (one line on stderr), 130 Ctrl-C; a bug is a traceback. `load`: 3 when some
    answers differ."""
    def body() -> int:
        args = build_parser().parse_args(argv)
        check_device(args.device)
        return {"export": cmd_export, "compare": cmd_compare, "load": cmd_load}[args.cmd](args)

    return run_command(body)


if __name__ == "__main__":
    raise SystemExit(main())

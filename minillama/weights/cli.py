"""The `minillama weights` command (`python -m minillama.weights`): fetch the default model, convert a
checkpoint to an HF directory, describe one (`info`, without dequantizing).

    python -m minillama.weights fetch | convert SRC OUT | info PATH
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

from minillama.errors import OneLineParser, run_command, say_at_terminal
from minillama.tokenizer import Tokenizer, TokenizerError, tokenizer_from_gguf_metadata

from .convert import convert, fits
from .default import fetch_default
from .gguf import _checked_gguf_config, check_gguf_layout, check_gguf_types, gguf_metadata, open_gguf
from .layout import WeightsError, expected_shapes
from .read import detect_format, given_path, load_state_dict, load_tokenizer


def info(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, without dequantizing: format, config, tensors, tokenizer."""
    p = given_path(path)
    fmt = detect_format(p)
    kinds: dict[str, int] = {}
    if fmt == "gguf":
        reader = open_gguf(p)
        meta = gguf_metadata(reader, p)
        for t in reader.tensors:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        check_gguf_types(reader, p)  # what loading would refuse, in its order, as an HF directory's info does
        config = _checked_gguf_config(meta, {t.name for t in reader.tensors}, p, reader)
        check_gguf_layout(reader, p, config)
        n_tensors = len(reader.tensors)
        try:
            tok: Tokenizer | None = tokenizer_from_gguf_metadata(meta, str(p))
        except TokenizerError as e:
            raise WeightsError(str(e)) from None
    else:
        config, sd = load_state_dict(p)
        for t in sd.values():
            name = str(t.dtype).removeprefix("torch.")
            kinds[name] = kinds.get(name, 0) + 1
        n_tensors = len(sd)
        tok = load_tokenizer(p) if fmt == "hf" or (p / "tokenizer.model").exists() else None
    fits(tok, config)
    n_params = sum(math.prod(s) for s in expected_shapes(config).values())
    return {
        "path": str(p), "format": fmt, "config": config.to_dict(), "context": config.context, "parameters": n_params,
        "tensors": n_tensors, "tensor_types": kinds,
        "tokenizer": None if tok is None else {
            "kind": type(tok).__name__, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
            "eos_ids": tok.eos_ids, "chat_template": tok.chat_template is not None},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status (`errors.run_command`): 0 done; 2 bad input, a checkpoint that cannot be used or a
    folder that cannot be written (one line on stderr); 130 Ctrl-C; 1 on a bug (a traceback)."""
    return run_command(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    ap = OneLineParser(prog="python -m minillama.weights", description="Fetch, convert and inspect Llama checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser, metavar="{fetch,convert,info}")
    f = sub.add_parser("fetch", help="download and convert the default model (SmolLM2-135M-Instruct)")
    f.add_argument("--force", action="store_true", help="download and convert again")
    c = sub.add_parser("convert", help="convert an HF/Meta directory or a .gguf file to a new HF directory")
    c.add_argument("src")
    c.add_argument("out", help="a new or empty directory")
    c.add_argument("--force", action="store_true",
                   help="replace OUT if it holds an earlier conversion (never anything else)")
    i = sub.add_parser("info", help="describe a checkpoint")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        print(fetch_default(force=args.force))
    elif args.cmd == "convert":
        t0 = time.perf_counter()
        out = convert(args.src, args.out, replace=args.force)
        say_at_terminal(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    else:
        d = info(args.path)
        if args.json:
            print(json.dumps(d, indent=2))
        else:
            _print_info(d)
    return 0


def _print_info(d: dict[str, Any]) -> None:
    c = d["config"]
    switches = [  # the family's (family.py), where set
        "biases q/k/v/o" if c["attention_bias"] else "biases q/k/v" if c["model_type"] == "qwen2" else "",
        "mlp biases" if c["mlp_bias"] else "", "q/k norm" if c["model_type"] == "qwen3" else "",
        f"sliding window {c['sliding_window']}" if c["sliding_window"] else ""]
    print(f"{d['path']}: {d['format']} checkpoint, {', '.join([c['model_type'], *filter(None, switches)])}, "
          f"{d['parameters'] / 1e6:.1f}M parameters")
    print(f"  layers {c['num_hidden_layers']}, hidden {c['hidden_size']}, ffn {c['intermediate_size']}, "
          f"heads {c['num_attention_heads']} (kv {c['num_key_value_heads']}, head dim {c['head_dim']}), "
          f"vocab {c['vocab_size']}")
    print(f"  rope theta {c['rope_theta']:g}, scaling {c['rope_scaling']}, rms eps {c['rms_norm_eps']:g}, "
          f"context {d['context']}, tied embeddings {c['tie_word_embeddings']}")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(d["tensor_types"].items()))
    print(f"  {d['tensors']} tensors: {kinds}")
    t = d["tokenizer"]
    if t is None:
        print("  tokenizer: none")
    else:
        print(f"  tokenizer: {t['kind']}, vocab {t['vocab_size']}, bos {t['bos_id']}, eos {t['eos_ids']}, "
              f"chat template {'yes' if t['chat_template'] else 'no'}")

"""The `minillama` command (also `python -m minillama`): one entry point for the five tools.

    minillama generate --doc doc.txt --questions q.txt    # = python -m minillama.generate
    minillama weights fetch                               # = python -m minillama.weights
    minillama oracle compare --backend transformers       # = python -m minillama.oracle
    minillama bench --quick                               # = python -m minillama.bench
    minillama serve --model PATH                          # = python -m minillama.serve

Each subcommand hands the rest of the command line to that tool's own `main()`, imported only when it
is chosen, so `minillama --help` starts without loading torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from .errors import OneLineParser, run_command
from .interrupts import hold_interrupts

# subcommand -> (module whose main() runs it, what it does)
COMMANDS = {
    "generate": ("minillama.cli", "answer questions about documents (parallel, independent or seqbatch)"),
    "weights": ("minillama.weights", "fetch the default model, convert checkpoints, describe them"),
    "oracle": ("minillama.oracle.__main__", "check another backend against minillama, step by step and layer by layer"),
    "bench": ("minillama.bench", "parallel prompting against the other methods, side by side"),
    "serve": ("minillama.serve.cli", "an OpenAI-compatible server, each answer bit-identical to its solo run"),
}

USAGE = "usage: minillama {" + ",".join(COMMANDS) + "} [options]  (minillama COMMAND --help for a command's options)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    lines = "\n".join([USAGE, "", *(f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items())])
    if not args:
        print(lines, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):  # through the one runner: a closed or full stdout is its one line, exit 2
        return run_command(lambda: print(lines) or 0)
    if args[0] not in COMMANDS:
        print(f"error: unknown command {args[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    hold_interrupts()  # a Ctrl-C while the tool imports torch: "interrupted", from the tool's run_command
    if argv is None:  # the `minillama` command itself: the tool names itself so in its usage and help
        OneLineParser.invoked_as = f"minillama {args[0]}"
    module = importlib.import_module(COMMANDS[args[0]][0])
    return module.main(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())

"""minillama on more than one process and machine, on PyTorch's own engine (torch.distributed).

    world.py    the process world: data-parallel groups of tensor-parallel ranks (a DeviceMesh), timeouts
    tp.py       tensor parallel: a loaded model sharded by whole KV-head units; sums in the model's fixed tree
    dp.py       data parallel: documents split by token count; answers streamed to rank 0, in input order
    launch.py   `--procs N`: N ranks on this machine, started as torchrun would start them
    parallel.py what the command line calls: join, place the model, share the documents, finish

Nothing here imports torch at module level except the modules that use it, so the command line's parser
stays quick. docs/distributed.md explains the commands and why the bits do not depend on the degree.
"""

from __future__ import annotations

import os


def launched() -> bool:
    """True in a process started by torchrun (or --procs) as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def add_options(parser, procs: bool = True) -> None:
    """The distributed options of a command line (generate; oracle export without --procs)."""
    d = parser.add_argument_group("more than one process (docs/distributed.md)")
    if procs:
        d.add_argument("--procs", type=int, default=1, metavar="N",
                       help="start N ranks on this machine (as torchrun --nproc-per-node N would): the documents "
                            "split over the data-parallel groups, --tp ranks to a group (default: 1)")
    d.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor parallel: the model's heads, MLP columns and vocabulary over T ranks; T divides "
                        "the KV heads (default: 1)")
    d.add_argument("--units", type=int, metavar="U",
                   help="issue every product in U fixed shards of whole KV-head groups: every --tp dividing U "
                        "gives the same bits (default: the KV heads when --tp > 1, else 1)")
    d.add_argument("--dist-timeout", type=float, default=600, metavar="S",
                   help="seconds a rank waits for another before the run ends with an error (default: 600)")


def check_options(args) -> None:
    """The distributed options of `minillama generate`, checked before anything slow (raises BadInput)."""
    from ..errors import BadInput

    for name in ("procs", "tp", "units"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise BadInput(f"--{name} must be at least 1, got {v}")
    if not (args.dist_timeout > 0) or args.dist_timeout == float("inf"):
        raise BadInput(f"--dist-timeout must be a number of seconds > 0, got {args.dist_timeout}")
    procs = getattr(args, "procs", 1)
    ranks = procs if procs > 1 else int(os.environ.get("WORLD_SIZE", "1"))
    if ranks % args.tp:
        how = f"--procs {procs}" if procs > 1 else f"{ranks} process{'es' * (ranks != 1)}"
        raise BadInput(f"--tp {args.tp} needs a multiple of {args.tp} processes, got {how}"
                       + ("; add --procs N or start with torchrun --nproc-per-node N" if ranks == 1 else ""))
    if args.units is not None and args.units % args.tp:
        raise BadInput(f"--units {args.units}: --tp {args.tp} must divide it")
    if launched() and procs > 1:
        raise BadInput("--procs starts its own ranks; under torchrun, leave it out")
    if launched() and "-" in (args.doc, args.questions, getattr(args, "input", None)):
        raise BadInput("under torchrun every rank reads the input: give files, not '-' (or use --procs N)")

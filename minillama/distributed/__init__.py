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
    from ..errors import world_env

    return (world_env()[0] or 1) > 1


def check_world_env() -> int:
    """The world size torchrun set (1 alone), or BadInput naming a WORLD_SIZE or RANK that no launcher sets."""
    from ..errors import BadInput, world_env

    size, rank = world_env()
    if size is None or size < 1:
        raise BadInput(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment: a number of processes "
                       ">= 1 (torchrun sets it); unset it, or start with torchrun or --procs")
    if size > 1 and (rank is None or not 0 <= rank < size):
        raise BadInput(f"RANK={os.environ.get('RANK')!r} in the environment: a rank in 0..{size - 1} of "
                       f"WORLD_SIZE {size} (torchrun sets both); unset them, or start with torchrun or --procs")
    return size


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
                        "gives the same bits (default: the KV heads, as in the API and the server)")
    d.add_argument("--dist-timeout", type=float, default=600, metavar="S",
                   help="seconds a rank waits for another before the run ends with an error (default: 600)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _either(ds: list[int]) -> str:
    return ", ".join(map(str, ds[:-1])) + f" or {ds[-1]}" if len(ds) > 1 else str(ds[0])


def check_degrees(kv_heads: int | None, tp: int, units: int | None, ranks: int = 1,
                  started: str | None = None, procs: bool = True) -> int | None:
    """Every degree and units check of a run, in one place; the units to use (default: the KV heads).

    A tensor-parallel rank holds whole units and a unit whole KV-head groups, so --tp divides --units, which
    divides the KV heads; the world is (ranks / tp) groups of --tp ranks. Raises BadInput (one line naming the
    KV heads and the values that divide them). kv_heads None: the model is not known yet (only the counts
    are checked, and None returned). started: how the ranks were asked for, and procs: whether the command
    has --procs, for the message."""
    from ..errors import BadInput

    if ranks % tp:
        how = started or f"{ranks} process{'es' * (ranks != 1)}"
        raise BadInput(f"--tp {tp} needs a multiple of {tp} processes, got {how}"
                       + (f"; {'add --procs N or ' * procs}start with torchrun --nproc-per-node N" if ranks == 1 else ""))
    if units is not None and units % tp:
        raise BadInput(f"--units {units}: --tp {tp} must divide it")
    if kv_heads is None:
        return None
    ok = _either(divisors(kv_heads))
    if kv_heads % tp:
        raise BadInput(f"--tp {tp}: the model's {kv_heads} KV heads do not divide into {tp} ranks; "
                       f"--tp must divide {kv_heads}: {ok}")
    if units is not None and kv_heads % units:
        raise BadInput(f"--units {units}: must divide the model's {kv_heads} KV heads: {ok}")
    return kv_heads if units is None else units


def check_options(args) -> None:
    """The distributed options of `minillama generate` and `oracle export`, checked before anything slow and
    before any rank starts or reads a weight (raises BadInput). With --tp or --units the checkpoint's config
    is read here (the default model fetched first), so a degree that does not divide its KV heads is refused
    as early as any other bad option."""
    from ..errors import BadInput

    for name in ("procs", "tp", "units"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise BadInput(f"--{name} must be at least 1, got {v}")
    if not MIN_TIMEOUT_S <= args.dist_timeout <= MAX_TIMEOUT_S:
        raise BadInput(f"--dist-timeout must be a number of seconds > 0, from {MIN_TIMEOUT_S:g} to "
                       f"{MAX_TIMEOUT_S:,}, got {args.dist_timeout}")
    procs, has_procs = getattr(args, "procs", 1), hasattr(args, "procs")  # oracle export has no --procs
    ranks = procs if procs > 1 else check_world_env()
    started = f"--procs {procs}" if procs > 1 else None
    check_degrees(None, args.tp, args.units, ranks, started, has_procs)
    check_gpu_index(getattr(args, "device", "cpu"), procs if procs > 1 else local_ranks())
    if launched() and procs > 1:
        raise BadInput("--procs starts its own ranks; under torchrun, leave it out")
    if launched():
        for path in (args.doc, args.questions, getattr(args, "input", None), getattr(args, "prompt_ids", None)):
            if path == "-" or (path and _stream(path)):
                raise BadInput(f"under torchrun every rank reads the input: give files, not {path!r}, which "
                               "each rank would read a different part of" + " (or use --procs N)" * has_procs)
    if args.tp > 1 or args.units is not None:
        check_degrees(model_kv_heads(getattr(args, "model", None)), args.tp, args.units, ranks, started, has_procs)


def local_ranks() -> int:
    """The ranks torchrun started on this machine (its LOCAL_WORLD_SIZE; 1 where unset or no number)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_gpu_index(device: str, local: int) -> None:
    """BadInput for a GPU named by its index (--device cuda:0) with more than one rank on this machine: each rank
    would take that one GPU (`parallel.join` gives each rank the GPU of its local rank only for --device cuda)."""
    import torch

    from ..errors import BadInput

    try:
        index = torch.device(device).index if device.startswith("cuda") else None
    except (RuntimeError, ValueError):  # not a device: check_device names it
        return
    if local > 1 and index is not None:
        raise BadInput(f"--device {device} with {local} ranks on this machine: every rank would take GPU {index}; "
                       "give --device cuda, and each rank takes the GPU of its local rank (cuda:LOCAL_RANK)")


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 10**7  # a process group's timeout: in whole milliseconds, and in a timedelta


def _stream(path: str) -> bool:
    """A pipe, a terminal or another stream (/dev/stdin, a fifo): read once, by whichever process reads first."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing or unreadable: the reader names it
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def model_kv_heads(path: str | None) -> int:
    """The KV heads of a checkpoint, from its config alone (no weight is read); BadInput when it cannot be read."""
    from ..errors import BadInput, one_line
    from ..weights import WeightsError, fetch_default, read_config

    if path and not os.path.lexists(path):  # a loop, a dangling link or "": the loader names it
        raise BadInput(f"--model {path}: no such file or directory")
    try:
        return read_config(fetch_default() if path is None else path).num_key_value_heads
    except (WeightsError, OSError) as e:
        raise BadInput(one_line(f"--model {path or '(default)'}: {e}")) from None

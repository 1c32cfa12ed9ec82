"""The errors that are the user's or the machine's, and the one runner every command line goes through.

Every command line of minillama (`generate`, `weights`, `oracle`, `bench`, `serve`), each hosted in its own
`cli`/`__main__` module and dispatched by `python -m minillama` (`minillama/__main__.py`), runs its body
through `run_command`, which maps what escapes to one line on stderr and an exit status (`check_device`
checks a `--device` the same way for every tool that takes one):

- 0: done (a tool may return 1 itself for a negative verdict, as the oracle does for a failed comparison,
  or 3, as `oracle load` does when some answers differ);
- 2: something the user gave cannot be used, or the machine refused (a `OneLineError`: bad input, a
  checkpoint that cannot be loaded, a file that cannot be written; or an `OSError` of the environment,
  such as a full disk or a read-only folder): `error: ...`, one line;
- 130: Ctrl-C;
- 141, quietly: the reader of stdout went away (`... | head -1`);
- 1, with a traceback: anything else, which is a bug in minillama. Catching every `ValueError` as
  "bad input" would hide those bugs, so only the types named here are turned into one line.

`report` is that mapping on its own, for a thread that must end the process itself (the answer-writing
thread of a distributed run). In a distributed run rank 0 alone says a one-line error, as every rank meets
the same bad input (and the first rank on each other machine, and a process whose RANK no launcher set:
`_speaks`), except a `RankRefused` (what the ranks agreed one of them refused, said where it was
raised) and a `SaidElsewhere` (this rank stops quietly: another has said why).

A Ctrl-C while a command is still importing torch is held until `run_command` can say "interrupted"
(interrupts.py).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import stat
import sys
from typing import Any, Callable, NoReturn

from .interrupts import release_interrupts


class OneLineError(Exception):
    """Reported in one line with exit status 2: the user's input or the machine, not a bug."""


class BadInput(OneLineError, ValueError):
    """Something the user gave that cannot be used: reported in one line, exit status 2."""


class RankRefused(OneLineError):
    """What the ranks of a distributed run refused, agreed among them (`distributed/dp.py`): said by the rank
    that raises it, whatever its rank (a rank on another machine says its own refusal where it runs)."""


class SaidElsewhere(OneLineError):
    """The run ends for a reason another rank has said (or, for a closed pipe, that needs no words): this
    rank stops quietly, exit status 2."""


class OutputRefused(OneLineError):
    """A write of an answer to stdout that the machine refused (a full disk), said with the count of answers
    written whole (`write_whole`); stdout then goes to /dev/null (`report`), so that Python's flush at exit
    does not fail again."""


class CannotWrite(OneLineError):
    """A file or folder that cannot be written (a full disk, a read-only or unwritable folder)."""

    def __init__(self, path: object, reason: str, what: str = "cannot write"):
        super().__init__(f"{path}: {what} ({reason})" if what else f"{path}: {reason}")
        self.path, self.reason = path, reason


# OSErrors that describe the machine, not minillama: reported in one line when they escape a command.
ENVIRONMENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "ENOSPC", "EDQUOT", "EFBIG", "EACCES", "EPERM", "EROFS", "EIO", "ENOTDIR", "EISDIR", "ENOENT", "EEXIST",
    "ENAMETOOLONG", "ELOOP", "EMFILE", "ENFILE", "ENOMEM", "EBADF") if hasattr(errno, n))


def say_at_terminal(msg: str) -> None:
    """Progress of slow work (downloading, converting, a load check), for a person at a terminal; logs and
    pipes get only the outcome, so a failure stays the one line that names it."""
    if sys.stderr is not None and sys.stderr.isatty():
        print(f"minillama: {msg}", file=sys.stderr, flush=True)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `BadInput` line (argparse prints the usage block, then the error),
    and an option of one value given twice is refused (argparse kept the last: `--questions a.txt
    --questions b.txt` answered b's alone, without a word)."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(message)

    invoked_as: str | None = None  # "minillama generate" when the `minillama` command runs the tool (__main__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        prog = kwargs.get("prog") or ""
        if self.invoked_as and prog.startswith("python -m minillama."):  # a tool's own name, in its usage and help,
            # as the user typed it (a subcommand's parser is named after its tool's, so it follows)
            kwargs["prog"] = self.invoked_as + prog[len(prog.split()[2]) + len("python -m "):]
        super().__init__(*args, **kwargs)
        for name in (None, "store"):  # every argument that stores one value, in argument groups too
            self.register("action", name, _Once)

    def print_help(self, file: Any = None) -> None:
        """The help, flushed here, so that a full stdout is `run_command`'s one line: argparse swallows the
        OSError of its write, and `--help > /dev/full` said nothing and exited 0."""
        out = file or sys.stdout
        out.write(self.format_help())
        out.flush()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.given: set[str] = set()  # the options of one value met in this parse (_Once)
        ns, rest = super().parse_known_args(args, namespace)
        # ...and in the namespace, a subcommand's with them: an option given at its default value is given.
        ns.options_given = getattr(ns, "options_given", set()) | self.given
        return ns, rest


class _Once(argparse._StoreAction):
    """An option of one value: a second of it (under either of its names) is refused."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = parser.__dict__.setdefault("given", set())
        if self.dest in given:
            parser.error(f"{'/'.join(self.option_strings)} given twice ({getattr(namespace, self.dest)!r}, then "
                         f"{values!r}): give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def one_line(s: str) -> str:
    """Any text as one line: runs of whitespace, line breaks included, made one space; other control
    characters written as escapes (an ESC from a user's value would reach the terminal as a command), and so
    is a byte of a path or an argument that is not UTF-8, which Python reads as U+DC00 plus the byte (`--doc
    $'\\xff.txt'` is named `\\xff.txt`, as the shell writes it, not `\\udcff.txt`)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()) & 0xFF:02x}", " ".join(str(s).split()))


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\udc80-\udcff]")


def check_device(device: str, option: str = "--device") -> None:
    """A torch device this machine can use, or BadInput: a name torch does not know, a device that cannot
    hold data and give it back here (CUDA without a GPU), or `meta` (shapes without numbers)."""
    import torch  # here: `minillama --help` and the weights tool start without torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise BadInput(f"{option} {device}: not a torch device") from None
    if dev.type == "cuda" and dev.index is None and "LOCAL_RANK" in os.environ:
        # A rank started by torchrun uses the GPU of its local rank (distributed/parallel.py): probe that one,
        # not the current device, where every rank would otherwise open a context on GPU 0.
        local = os.environ["LOCAL_RANK"]
        if not local.strip().isdigit():
            raise BadInput(f"LOCAL_RANK={local!r} in the environment: the index of this rank's GPU, >= 0 (torchrun "
                           f"sets it); unset it, or start with torchrun")
        dev = torch.device("cuda", int(local))
    if dev.type == "meta":  # before the probe below, whose read-back a meta tensor refuses in torch's words
        raise BadInput(f"{option} {device}: holds shapes, not numbers; choose cpu or an accelerator")
    try:
        torch.zeros(1, device=dev).cpu()
    except (RuntimeError, AssertionError, ValueError, NotImplementedError) as e:
        said = first_line(e).split(". ")[0]  # the rest: advice for torch's makers
        if re.match(r"Could not run '.*' with arguments from the '.*' backend", said):  # then a page of backends
            said = f"this torch was built without the {dev.type} backend"
        raise BadInput(f"{option} {device}: not usable here ({said[:300]})") from None


def out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, torch's (a GPU's) OutOfMemoryError, or its CPU allocator's refusal."""
    torch = sys.modules.get("torch")  # not imported: no torch allocation can have failed
    return (isinstance(e, MemoryError)
            or (torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())))
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))


def memory_cause(e: BaseException) -> str:
    """`out of memory (what the allocator said, its first line)` for an `out_of_memory` error."""
    return f"out of memory ({one_line(first_line(e))[:300]})"


def first_line(e: BaseException) -> str:
    """An exception's message, its first line (its type's name where it has none)."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def check_cpu_env() -> None:
    """The CPU's variables (MINILLAMA_CPU_16BIT, MINILLAMA_CPU_GEMM) read once, before anything slow: BadInput
    naming the one that is wrong, rather than the first product's error (a server's every request)."""
    from . import precision

    try:
        precision.cpu_mode()
        precision.cpu_gemm()
    except ValueError as e:
        raise BadInput(str(e)) from None


def _stderr_to_devnull_if_unusable() -> None:
    """Started with stderr closed (`2>&-`: sys.stderr is None, and print(file=None) writes to stdout) or open
    for reading only: what would be said goes to /dev/null, so that none of it lands in the output and no
    failed write changes the exit status. A stderr that is no file (a test's capture) is left alone."""
    if sys.stderr is not None:
        try:
            fd = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            return
        try:
            import fcntl

            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                return
        except ImportError:  # no fcntl (Windows): Python's own checks stand
            return
        except OSError:
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != 2:  # fd 2 itself, not a file opened later, must not be the output's
        os.dup2(devnull, 2)
        os.close(devnull)
    sys.stderr = open(2, "w", closefd=False)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail a second time (a closed
    pipe, a full device) and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def quiet_exit_on_broken_pipe() -> int:
    """The reader of stdout went away (`... | head -1`): stop quietly, as Unix tools do, with the status a
    shell reports for a process ended by SIGPIPE."""
    _stdout_to_devnull()
    return 141


def write_whole(out: Any, text: str, written: str) -> None:
    """Write `text` (one answer) to `out` (stdout) and flush it; where the machine refuses (a full disk), raise
    OutputRefused saying what was `written` before it ("2 of 4 answers written"). Where `out` has a descriptor,
    its UTF-8 bytes go to it in as many writes as it takes (Python's text layer, unbuffered as under `python -u`,
    dropped the rest of a short write without a word). A regular file written at its end that took part of
    them, and holds nothing past where they began but theirs, is cut back there, its offset with it (stderr
    may share it: `> out 2>&1`); what reached a pipe or a device cannot be taken back, and the line says so."""
    start = None
    try:
        try:
            fd = out.fileno()
        except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture): io.UnsupportedOperation
            out.write(text)
            out.flush()
            return
        out.flush()  # what Python holds goes first
        data = memoryview(text.encode("utf-8"))  # JSON Lines are UTF-8, and so is any answer the model writes
        with contextlib.suppress(OSError):
            at = os.lseek(fd, 0, os.SEEK_CUR)
            if stat.S_ISREG(os.fstat(fd).st_mode) and at == os.fstat(fd).st_size:
                start, end = at, at + len(data)  # at its end: not under `1<>file`, which overwrites what follows
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        if isinstance(e, BrokenPipeError) or e.errno not in ENVIRONMENT_ERRNOS:
            raise
        whole = False
        with contextlib.suppress(OSError):
            if start is not None and start <= os.fstat(fd).st_size <= end:
                os.ftruncate(fd, start)
                whole = os.lseek(fd, start, os.SEEK_SET) == start
        raise OutputRefused(f"{describe_os_error(e)}; {written}" + ("" if whole else " whole, and perhaps part "
                                                                      "of the next")) from None


def describe_os_error(e: OSError) -> str:
    """`PATH: cannot write (No space left on device)`-like text for an OSError of the environment."""
    why = e.strerror or type(e).__name__
    return f"{e.filename}: {why}" if e.filename else f"cannot write the output ({why})"


def world_env() -> tuple[int | None, int | None]:
    """(WORLD_SIZE, RANK) as torchrun (or --procs) sets them: 1 and 0 where unset, None where no integer."""
    def read(name: str, default: int) -> int | None:
        try:
            return int(os.environ.get(name, str(default)))
        except ValueError:
            return None
    return read("WORLD_SIZE", 1), read("RANK", 0)


def _speaks() -> bool:
    """Whether this process says a refusal that every rank of a distributed run meets alike: rank 0 of the
    run, and the first process on each machine under torchrun (LOCAL_RANK 0: a machine without rank 0 would
    otherwise show nothing); any process alone, or whose RANK no launcher set (no LOCAL_RANK beside it, or a
    rank outside its WORLD_SIZE, refused in this very line: no rank 0 will speak for it)."""
    size, rank = world_env()
    if (size or 1) <= 1 or rank is None or not 0 <= rank < size:
        return True
    return rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"


def run_command(body: Callable[[], int]) -> int:
    """Run a command line's body and turn what escapes into an exit status (the module docstring)."""
    _stderr_to_devnull_if_unusable()
    if sys.stdout is None:  # started with stdout closed (`>&-`): the output would be lost
        print("error: standard output is closed; the output would be lost", file=sys.stderr)
        return 2
    try:
        release_interrupts()
        code = body()
        sys.stdout.flush()  # a closed pipe or a full device shows here, inside the handlers
        return code
    except BaseException as e:
        code = report(e)
        if code is None:
            raise
        return code


def report(e: BaseException) -> int | None:
    """Say what `e` means in one line (or nothing) and return the exit status; None for a bug, which the
    caller lets through as a traceback. `run_command` uses it, and so does a thread of a command that must
    end the process itself (the answer-writing thread of a distributed run)."""
    if isinstance(e, SaidElsewhere):
        return 2
    if isinstance(e, OneLineError):
        if isinstance(e, OutputRefused):
            _stdout_to_devnull()
        # in a distributed run every rank meets the same bad input: one says so
        if _speaks() or isinstance(e, RankRefused):
            print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    if isinstance(e, BrokenPipeError):
        return quiet_exit_on_broken_pipe()
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130
    if out_of_memory(e):  # the machine's refusal, as a full disk is: what ran out, in one line
        print(f"error: {memory_cause(e)}; free memory, or ask for less (a smaller model, shorter input, fewer "
              "questions at once)", file=sys.stderr)
        return 2
    if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
        if e.filename is None:  # a write to stdout failed: Python would fail again at exit
            _stdout_to_devnull()
        print(f"error: {one_line(describe_os_error(e))}", file=sys.stderr)
        return 2
    return None

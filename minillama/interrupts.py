"""Ctrl-C while a command starts: held until the command's `errors.run_command` can say "interrupted".

Raised inside an import (torch's takes seconds), a Ctrl-C was a traceback, or, where a library's import
swallowed it, a half-imported numpy that failed later as a bug in minillama. This module imports nothing
of minillama's, only the standard library's, so the package can install the handler before its first other import.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator

_held: list[int] = []  # a Ctrl-C that came during an import, while hold_interrupts' handler was in place


def hold_interrupts() -> None:
    """Until `run_command` starts, hold a Ctrl-C that comes during an import (one that comes elsewhere is
    raised at once, as Python's own handler does). Called before a command's first import of torch: by
    the `minillama` entry point, and by the package when it is run as `python -m minillama.X`."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not one ignored (`&` in a script)
            signal.signal(signal.SIGINT, _on_interrupt)
    except ValueError:  # not the main thread: signals are not this thread's
        pass


def _on_interrupt(signum: int, frame: object) -> None:
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            _held.append(signum)
            return
        f = f.f_back
    raise KeyboardInterrupt


def release_interrupts() -> None:
    """Python's own Ctrl-C handler again, where `hold_interrupts` replaced it; a held Ctrl-C is raised now."""
    try:
        if signal.getsignal(signal.SIGINT) is _on_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass
    if _held:
        _held.clear()
        raise KeyboardInterrupt


def starting_a_command() -> bool:
    """Whether Python is importing this package to run one of its commands (`python -m minillama...`: while
    the package is imported, Python's argv[0] is "-m"), not a program of its own that imports it."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(a == "-m" and b.split(".")[0] == "minillama" for a, b in zip(argv, argv[1:]))


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, so that what it writes and what it counts agree (an answer and
    the count of answers written: "0 of N written" after one). A second Ctrl-C is raised at once (a write
    blocked on a reader that does not read still ends); outside the main thread, or where SIGINT is not
    Python's own handler's, the block runs as it is."""
    got: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(signum)

    try:
        held = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if held:
            signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main thread: signals are not this thread's
        held = False
    if not held:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if got:
        raise KeyboardInterrupt

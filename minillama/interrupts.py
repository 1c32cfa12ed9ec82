"""Ctrl-C while a command starts: held until the command's `errors.run_command` can say "interrupted".

Raised inside an import (torch's takes seconds), a Ctrl-C was a traceback, or, where a library's import
swallowed it, a half-imported numpy that failed later as a bug in minillama. Once the command runs, a Ctrl-C
that lands in the import machinery (a lazy import while loading) is sent again a moment later: raised inside
importlib's module-lock callback, Python printed "Exception ignored" and the run went on to exit 0. This module
imports nothing of minillama's, only the standard library's, so the package can install the handler before its
first other import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

_held: list[int] = []  # a Ctrl-C that came during an import, while hold_interrupts' handler was in place
_started: list[bool] = []  # the command runs (release_interrupts): a Ctrl-C in an import is sent again
AGAIN_S = 0.05  # how soon a Ctrl-C that came during an import, once the command runs, is sent again


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
            if _started:  # raised here it could be swallowed: again once the import is done
                threading.Timer(AGAIN_S, os.kill, (os.getpid(), signum)).start()
            else:
                _held.append(signum)
            return
        f = f.f_back
    raise KeyboardInterrupt


def release_interrupts() -> None:
    """The command runs: a held Ctrl-C is raised now; from here on one is raised at once, or, where it comes
    during an import, a moment later (where `hold_interrupts` put its handler in place)."""
    _started[:] = [True]
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
    blocked on a reader that does not read still ends); outside the main thread, or where SIGINT is
    neither Python's own handler nor `hold_interrupts`', the block runs as it is."""
    got: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(signum)

    try:
        previous = signal.getsignal(signal.SIGINT)
        held = previous in (signal.default_int_handler, _on_interrupt)
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
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt

"""The one kind of error that is the user's: bad input, reported in one line with exit status 2.

Every command line of minillama (`python -m minillama.generate`, `python -m minillama.weights`,
`python -m minillama.oracle`) raises `BadInput` for something the user gave that cannot be used (a missing
file, a malformed line, an option out of range) and turns it into `error: ...` on stderr and exit 2.
Anything else that escapes is a bug in minillama and surfaces as a traceback (exit 1): catching every
`ValueError` as "bad input" would hide those bugs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


class BadInput(ValueError):
    """Something the user gave that cannot be used: reported in one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `BadInput` line (argparse prints the usage block, then the error)."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(message)


def quiet_exit_on_broken_pipe() -> int:
    """The reader of stdout went away (`... | head -1`): stop quietly, as Unix tools do, with the status a
    shell reports for a process ended by SIGPIPE. stdout is pointed at /dev/null first, so that Python's
    own flush at exit does not fail a second time and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141

"""The options of a run, each declared once: its Python name, its command-line flag, its help and its check.

`SamplingParams` (generate.py) declares each of its fields with `option(...)`; `checks.RUN_OPTIONS` declares
the rest of `api.ask_many`'s options the same way. From these one table come the command line's options
(`cli.build_parser`), the API's checks (`checks.check_options`, `SamplingParams.__post_init__`) and every
refusal's message, spelled the caller's way: `top_p must be in (0, 1] (1: off), got 2` from the API,
`--top-p must be in (0, 1] (1: off), got 2` from the command line. A row without a flag says why it has none.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import re
from typing import Any, Callable, Sequence

from .errors import BadInput

# A rule raises BadInput (or BadType) when the value, named as the caller spells it, is not good.
Rule = Callable[[Any, str], None]


class BadType(BadInput, TypeError):
    """A value of the wrong type (a string where a list belongs, bytes where text belongs)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One row of the table: how an option is checked, and how the command line offers it."""

    help: str
    rules: tuple[Rule, ...]
    flag: str | None = None  # "--top-k"; None: the Python API only, and `no_flag` says why
    short: str | None = None  # "-n"
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # a flag's text to a value (int, float); None: the text itself
    action: str | None = None  # "store_true", "store_false" or "append"
    group: str = "generation"  # the command line's help section
    default: Any = None  # the API's default (a SamplingParams field's is its dataclass default)
    cli_default: Any = None  # where the command line starts elsewhere (--stop: []); None: at `default`
    no_flag: str | None = None

    def check(self, name: str, value: Any) -> Any:
        """Raise BadInput/BadType for a bad `value`; `name` is the option as the caller spells it. Returns the
        value, an integer of numpy's or torch's as Python's (`is_int`), once a rule has taken it as one."""
        for rule in self.rules:
            rule(value, name)
            value = int(value) if is_int(value) else value
        return value


def option(default: Any, flag: str | None, help: str, *rules: Rule, **how: Any) -> Any:
    """A dataclass field declared with its row of the table (its `metadata["option"]`)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, rules, flag, default=default, **how)})


def table(cls: type) -> dict[str, Option]:
    """The rows of a dataclass declared with `option`: field name -> Option."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(cls)}


def parse_or_keep(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` that keeps text it cannot parse, so that the table's rule refuses it in the API's
    words (`--top-k must be an integer, got 'x'`) rather than argparse's."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError:
            return text
    convert.__name__ = parse.__name__
    return convert


# --- rules ------------------------------------------------------------------------------------------


def is_int(x: Any) -> bool:
    """An integer: Python's, numpy's, or a 0-d integer tensor or array (`torch.tensor(3)`), not a bool. Code
    that checked with this converts with `int()` before any arithmetic (numpy's int8 wraps at 127)."""
    if isinstance(x, numbers.Integral):
        return not isinstance(x, bool)
    if getattr(x, "ndim", None) != 0 or "bool" in str(getattr(x, "dtype", "bool")):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_finite(x: Any) -> bool:
    """A real number that is not inf or NaN, nor an integer too large for a float (10**400)."""
    try:
        return is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


def need(ok: Callable[[Any], bool], what: str, kind: type = BadInput, optional: bool = False) -> Rule:
    """A rule: `ok(value)` or `NAME must be WHAT, got VALUE`; `optional` lets None through."""
    def rule(value: Any, name: str) -> None:
        if not (optional and value is None) and not ok(value):
            raise kind(f"{name} must be {what}, got {value!r}")
    return rule


INTEGER = need(is_int, "an integer", BadType)
NUMBER = need(is_real, "a number", BadType)
BOOLEAN = need(lambda v: isinstance(v, bool), "True or False", BadType)


def at_least(least: int, what: str | None = None, optional: bool = False) -> Rule:
    return need(lambda v: v >= least, what or f"at least {least}", optional=optional)


def one_of(choices: Sequence[str]) -> Rule:
    return need(lambda v: isinstance(v, str) and v in choices, f"one of {', '.join(choices)}")


def strings(value: Any) -> tuple[str, ...]:
    """One string, or a list or tuple of them, as a tuple (one string is one stop string, as OpenAI, vLLM
    and HF take it); anything else as an empty tuple (the type rule refuses it)."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else ()


def stops_or_function(value: Any, name: str) -> None:
    """None, a function of the answer's ids (`SamplingParams.stop`), one string, or a list of strings."""
    if not (value is None or callable(value) or isinstance(value, str)
            or (isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value))):
        raise BadType(f"{name} must be a string or a list of strings, got {value!r}")


MAX_STOP_CHARS = 1024  # a stop string's length: what an answer holds back while it might be starting


def non_empty_texts(value: Any, name: str) -> None:
    """Each string of `value` (one or a list) not empty, at most `MAX_STOP_CHARS` long, and text (`text`)."""
    for s in strings(value):
        if s == "":
            raise BadInput(f"{name} must be non-empty, got ''")
        if len(s) > MAX_STOP_CHARS:
            raise BadInput(f"{name}: a stop string of {len(s)} characters; at most {MAX_STOP_CHARS}")
        text(s, name)


def text(value: Any, name: str) -> None:
    """Text that can be encoded: a lone surrogate (from a JSON "\\ud800" escape) is not a character."""
    m = re.search("[\ud800-\udfff]", value) if isinstance(value, str) else None
    if m and name.startswith("--") and 0xDC80 <= ord(m.group()) <= 0xDCFF:  # how Python reads a byte of argv
        raise BadInput(f"{name}: the byte 0x{ord(m.group()) - 0xDC00:02X} at character {m.start()} is not UTF-8 "
                       "(the command line is read as UTF-8)")
    if m:
        raise BadInput(f"{name}: a lone surrogate U+{ord(m.group()):04X} at character {m.start()} is not "
                       "text (it cannot be encoded as UTF-8)")

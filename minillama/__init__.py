"""minillama: a pure-PyTorch Llama reference whose parallel prompting is bit-identical to independent runs.

    import minillama
    model = minillama.load()                                  # the default model, or load("path")
    replies = minillama.ask(model, doc, ["Who built it?"])    # .text .token_ids .logprobs .finish_reason

The API lives in `minillama.api`; it is imported lazily so that `python -m minillama.generate` starts clean, and
so is every submodule named as an attribute (`minillama.generate.SamplingParams` works after `import minillama`).

Importing the package chooses how torch's OpenMP threads wait, before anything loads torch (threads.py:
they sleep at once where other work wants the cores, spin briefly otherwise). Run as `python -m minillama.X`,
it holds a Ctrl-C that comes while the command imports torch until the command can say "interrupted"
(interrupts.py).
"""

from .interrupts import hold_interrupts, starting_a_command

if starting_a_command():  # `python -m minillama.X` is importing its module: a Ctrl-C now waits for the command
    hold_interrupts()

from .threads import choose_wait_policy  # noqa: E402  (after the handler: any import may be interrupted)

choose_wait_policy()

_API = ("api", "load", "ask", "ask_many", "prompt_ids", "Reply", "LoadedModel")


def __getattr__(name: str):
    import importlib
    import importlib.util

    if name in _API:
        api = importlib.import_module(".api", __name__)
        return api if name == "api" else getattr(api, name)
    # A submodule, imported when first named (`minillama.generate.SamplingParams` after `import minillama`), so
    # that importing the package stays cheap: no torch until something needs it.
    if name.isidentifier() and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'minillama' has no attribute {name!r}")

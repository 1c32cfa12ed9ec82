"""minillama: a pure-PyTorch Llama reference whose parallel prompting is bit-identical to independent runs.

    import minillama
    model = minillama.load()                                  # the default model, or load("path")
    replies = minillama.ask(model, doc, ["Who built it?"])    # .text .token_ids .logprobs .finish_reason

The API lives in `minillama.api`; it is imported lazily so that `python -m minillama.generate` starts clean.

One setting is made here, before anything loads torch: OpenMP threads that wait for each other sleep
rather than spin (`OMP_WAIT_POLICY=PASSIVE`, unless the environment already names a policy). A forward pass
opens thousands of small parallel regions (3,300 in a 128-row decode step of the default model), each ending
in a barrier; with another process on the CPU, a spinning thread holds a core that its own descheduled
partner needs to reach that barrier, and a 2-thread run on a 2-core machine slowed from 3-5 s to 14-180 s
(docs/bench/README.md#a-cpu-shared-with-other-work). OpenMP reads the policy once, when torch loads it:
a program that imported torch first keeps the runtime's own default.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_API = ("api", "load", "ask", "ask_many", "prompt_ids", "Reply", "LoadedModel")


def __getattr__(name: str):
    if name in _API:
        import importlib

        api = importlib.import_module(".api", __name__)
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'minillama' has no attribute {name!r}")

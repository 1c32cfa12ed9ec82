"""A real `minillama serve` on loopback for the tests: a tiny checkpoint, the app under uvicorn in a thread
(always shut down), and the solo runs every served answer is compared with."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from minillama import api
from minillama.generate import generate
from minillama.serve.app import build_app
from minillama.serve.cli import bind
from minillama.serve.engine import Engine
from minillama.weights import save_hf_dir
from test_api import DOC, tiny_tokenizer
from tiny import tiny_config, tiny_model

CONTEXT = 512


def write_checkpoint(out: Path) -> Path:
    """Shapes at which plain kernels are not batch-invariant (the negative controls need that): 6 heads of
    32, a vocabulary of 300 byte-level BPE ids with a ChatML template."""
    tok = tiny_tokenizer()
    config = tiny_config(layers=2, heads=6, kv_heads=2, head_dim=32, vocab=tok.vocab_size, max_pos=CONTEXT, tied=True)
    return save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, out)


def eos_of(model: api.LoadedModel) -> list[int]:
    return list(dict.fromkeys([*model.tokenizer.eos_ids, *model.llama.config.eos_token_ids]))


@contextlib.contextmanager
def serving(model: api.LoadedModel, name: str = "tiny", api_key: str | None = None, **engine: Any) -> Iterator[str]:
    """The app on 127.0.0.1 (a free port) in a thread; yields its base URL (…/v1); stops it on exit."""
    import uvicorn

    options = dict(max_running=64, max_queue=256, max_batch_tokens=256)
    options.update(engine)
    eng = Engine(model.llama, eos_of(model), **options)
    app = build_app(model, eng, name, max_tokens=256, api_key=api_key, max_body_bytes=64 << 10)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > 60:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive() and not eng.thread.is_alive(), "the server did not stop"


def solo(model: api.LoadedModel, prompt: list[int], n: int, body: dict[str, Any]) -> list[Any]:
    """The request's choices answered alone through `generate(..., mode="independent")`: choice i is
    question i of n copies of the prompt (its random stream (seed, i))."""
    params = api.sampling_params(body.get("max_tokens", 16), body.get("temperature", 1.0), body.get("top_k", 0),
                                 body.get("top_p", 1.0), body.get("seed", 0), body.get("ignore_eos", False),
                                 [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", ()),
                                 model.tokenizer)
    return generate(model.llama, [prompt] * n, params, mode="independent", eos_ids=eos_of(model))


def solo_prompt_logprobs(model: api.LoadedModel, prompt: list[int]) -> list[float | None]:
    """Each prompt token's log-prob given the tokens before it, from one stand-alone pass."""
    lp = torch.log_softmax(model.llama(torch.tensor(prompt)).float(), dim=-1)
    return [None] + [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]


LONG_DOC = " ".join([DOC] * 3)  # about 150 tokens: two whole prefix blocks and a tail

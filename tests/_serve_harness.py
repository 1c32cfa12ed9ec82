"""A real `minillama serve` on loopback for the tests: a tiny checkpoint, the app under uvicorn in a thread
(always shut down); the solo runs every served answer is compared with are minillama.serve.identity's."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from minillama import api
from minillama.serve.app import build_app
from minillama.serve.cli import serve_in_thread
from minillama.serve.engine import Engine
from minillama.serve.identity import eos_of
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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The tiny checkpoint, written once per test module."""
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def model(ckpt: Path) -> api.LoadedModel:
    return api.load(ckpt)


@contextlib.contextmanager
def serving(model: api.LoadedModel, name: str = "tiny", api_key: str | None = None, **engine: Any) -> Iterator[str]:
    """The app on 127.0.0.1 (a free port) in a thread; yields its base URL (…/v1); stops it on exit."""
    options = dict(max_running=64, max_queue=256, max_batch_tokens=256)
    options.update(engine)
    eng = Engine(model.llama, eos_of(model), **options)
    app = build_app(model, eng, name, max_tokens=256, api_key=api_key, max_body_bytes=64 << 10)
    with serve_in_thread(app) as url:
        yield url
    assert eng.ended.is_set() and not eng.thread.is_alive(), "the server did not stop"


LONG_DOC = " ".join([DOC] * 3)  # about 150 tokens: two whole prefix blocks and a tail

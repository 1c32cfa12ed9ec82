"""The official `openai` Python SDK against a real `minillama serve` process on loopback: completions, chat,
streaming, vLLM's extra fields through `extra_body`, and a refusal as the SDK's own error; the answers'
tokens and log-probs are those of the solo runs."""

from __future__ import annotations

import openai
import pytest

from minillama.serve.identity import solo
from _serve_harness import LONG_DOC, ckpt, model  # noqa: F401  (fixtures)
from test_serve_faults import start_server

IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(ckpt):
    p, url = start_server(ckpt, "--api-key", "sesame")
    try:
        with openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=120) as c:
            yield c
    finally:
        p.terminate()
        assert p.wait(60) == 0


def test_completions_and_streaming_through_the_sdk(client, model):
    tok = model.tokenizer
    prompt = f"{LONG_DOC} Who?"
    want = solo(model, tok.encode(prompt, add_special=True, parse_special=False), 2,
                {"max_tokens": 8, "temperature": 0.9, "seed": 5, "ignore_eos": True})
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=5, n=2,
                                    logprobs=0, extra_body=IDS)
    for choice, a in zip(sorted(got.choices, key=lambda c: c.index), want):
        assert [int(t[9:]) for t in choice.logprobs.tokens] == a.token_ids
        assert choice.logprobs.token_logprobs == a.logprobs and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 16
    streamed = [0] * 2
    text = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=5, n=2,
                                           stream=True, extra_body=IDS):
        for c in chunk.choices:
            streamed[c.index] += 1
            text[c.index] += c.text
    assert text == [c.text for c in sorted(got.choices, key=lambda c: c.index)] and min(streamed) >= 8


def test_chat_through_the_sdk(client, model):
    messages = [{"role": "user", "content": "Who built the bridge?"}]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body=IDS)
    prompt = model.tokenizer.encode_chat(messages, add_generation_prompt=True)
    a = solo(model, prompt, 1, {"max_tokens": 6, "temperature": 0, "ignore_eos": True})[0]
    lp = got.choices[0].logprobs.content
    assert [int(e.token[9:]) for e in lp] == a.token_ids and [e.logprob for e in lp] == a.logprobs
    assert all(len(e.top_logprobs) == 2 for e in lp)
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IDS) if chunk.choices]
    assert "".join(pieces) == got.choices[0].message.content
    assert client.models.retrieve("tiny").id == "tiny"


def test_refusals_are_the_sdks_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"typical_p": 0.5})
    assert e.value.body["param"] == "typical_p"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")

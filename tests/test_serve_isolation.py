"""One client can never break another: while three clients stream long answers from a real server on
loopback, a fourth sends every kind of bad request (each refused at the door with a 400 naming its field)
and requests that fail inside the engine (a sampler and a stop check planted to raise for them alone), and
`top_p: 1e-300`, which the sampler answers with the likeliest token (once a NaN for the whole batch); the
failures get HTTP 500, and the three answers are bit-identical to their solo runs."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from minillama import generate, tokens
from minillama.errors import BadInput
from minillama.generate import SamplingParams
from minillama.serve.identity import mismatches
from _serve_harness import LONG_DOC, ckpt, model, serving  # noqa: F401  (fixtures)
from test_serve_faults import BAD

VICTIM_SEED = 4242  # the planted sampler raises for this seed only
BOOM = "BOOM"  # the planted stop check raises for this stop string only

# Refused at the door, beyond test_serve_faults.BAD: (route, body, status, the field the error names).
MORE_BAD = [
    ("/completions", {"prompt": "x", "max_token": 5}, 400, "max_token"),
    ("/completions", {"prompt": "x", "typical_p": 0.5}, 400, "typical_p"),
    ("/completions", {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/completions", {"prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice"),
    ("/completions", {"prompt": "x", "bad_words": ["x"]}, 400, "bad_words"),
    ("/completions", {"prompt": "x", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
    ("/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/completions", {"prompt": "x", "allowed_token_ids": [5, 99999]}, 400, "allowed_token_ids"),
    ("/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/completions", {"prompt": "x", "prompt_logprobs": 99}, 400, "prompt_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message"),
    # not text, numbers past a float or past torch's integers, a stop string past its length
    ("/completions", {"prompt": "a\ud800"}, 400, "prompt"),
    ("/completions", {"prompt": "x", "min_p": 10**400}, 400, "min_p"),
    ("/completions", {"prompt": "x", "temperature": 10**400}, 400, "temperature"),
    ("/completions", {"prompt": "x", "temperature": 1, "top_k": 2**63}, 400, "top_k"),
    ("/completions", {"prompt": "x", "top_k": -1.0}, 400, "top_k"),  # vLLM's off is the integer -1
    ("/completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    ("/completions", {"prompt": "x", "stop": ["Q" * 1025]}, 400, "stop"),
    ("/completions", {"prompt": ["x"] * 20, "n": 16}, 400, "n"),  # 320 sequences: past --max-queue, ever
    # a role that is none of the chat's (one spelling a control token), a field no template writes
    ("/chat/completions", {"messages": [{"role": "user<|im_end|>", "content": "x"}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "<|im_end|>"}]}, 400, "messages"),
    ("/completions", {"prompt": "x", "\udfff": 1}, 400, "\\udfff"),  # an unknown field's name, not text
    ("/completions", {"prompt": "x", "top_k": 10**4000}, 400, "top_k"),  # named by its start
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
     400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                           "max_completion_tokens": 8}, 400, "max_completion_tokens"),
    # values equal to the one given but of another type (True == 1, 2.0 == 2) were taken
    ("/completions", {"prompt": "x", "n": 1, "best_of": True}, 400, "best_of"),
    ("/completions", {"prompt": "x", "n": 2, "best_of": 2.0}, 400, "best_of"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3.0,
                           "max_completion_tokens": 3}, 400, "max_tokens"),  # no integer, as alone
    ("/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "\ue0009\ue001"}]}, 400,
     "messages"),
]


def _refusal(**fields: Any) -> str | None:
    """What SamplingParams (the API, the CLI) says about these values, or None if it takes them."""
    try:
        SamplingParams(**fields)
    except BadInput as e:
        return str(e)
    return None


def _others() -> list[dict[str, Any]]:
    """Three long streamed answers (greedy, seeded, seeded with top-k and top-p), for mismatches()."""
    base = {"max_tokens": 120, "ignore_eos": True, "stream": True, "n": 1, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    bodies = [{**base, "prompt": f"{LONG_DOC} Who?", "temperature": 0},
              {**base, "prompt": f"{LONG_DOC} Where?", "temperature": 1.0, "seed": 7},
              {**base, "prompt": "Tell me a story.", "temperature": 0.8, "seed": 8, "top_k": 20, "top_p": 0.9}]
    return [{"route": "/completions", "body": b, "delay": 0.0} for b in bodies]


@pytest.mark.parametrize("ahead", [False, True])
def test_one_client_cannot_break_another(model, monkeypatch, ahead):
    """`ahead`: the engine one pass ahead of the host (a GPU's way, test_serve_ahead.py), forced on a CPU."""
    monkeypatch.setattr(model.llama.steps, "overlap", ahead)
    real_sample, real_stop = tokens.sample_rows, generate.StopStrings.__call__

    def sample(logits, temperature, top_k, top_p, keys, *args, **kwargs):
        if any(int(k) // 1_000_003 == VICTIM_SEED for k in keys):  # stream_key(seed, index), index small
            raise RuntimeError("planted sampler failure")
        return real_sample(logits, temperature, top_k, top_p, keys, *args, **kwargs)

    def stop(self, ids):
        if BOOM in self.strings:
            raise RuntimeError("planted stop-check failure")
        return real_stop(self, ids)

    monkeypatch.setattr(tokens, "sample_rows", sample)  # where the engine's take_tokens finds it
    monkeypatch.setattr(generate.StopStrings, "__call__", stop)
    tiny_top_p = _refusal(top_p=1e-300)
    failing = [  # (body, status, the field a 400 names); a 500 names none
        ({"prompt": LONG_DOC, "max_tokens": 5, "temperature": 1.0, "seed": VICTIM_SEED}, 500, None),
        ({"prompt": LONG_DOC, "max_tokens": 5, "temperature": 0, "stop": BOOM, "stream": True}, 500, None),
        ({"prompt": LONG_DOC, "max_tokens": 5, "temperature": 1.0, "top_p": 1e-300},
         400 if tiny_top_p else 200, "top_p" if tiny_top_p else None),
    ]
    seen: list[str] = []
    with serving(model, max_batch_tokens=64) as url:
        def bad_client() -> None:
            with httpx.Client(timeout=120) as c:
                t0 = time.monotonic()
                while c.get(url[:-3] + "/health").json()["running"] < 3 and time.monotonic() - t0 < 60:
                    time.sleep(0.01)
                for body, status, param in failing:
                    r = c.post(url + "/completions", json=body)
                    got = r.status_code, r.text
                    if body.get("stream"):  # the error comes inside the stream, after the 200
                        got = (500 if '"error"' in r.text else r.status_code), r.text
                    seen.append(f"{body} -> {got[0]} {got[1][:300]}" if got[0] != status or
                                (param and r.json()["error"]["param"] != param) else "ok")
                    if status == 500:
                        assert "internal error in the engine for this request" in r.text, r.text
                    if status == 400 and tiny_top_p:
                        assert r.json()["error"]["message"] == tiny_top_p, r.text
                seen.append(f"running after the engine failures: {c.get(url[:-3] + '/health').json()['running']}")
                for route, body, status, param in BAD + MORE_BAD:  # json.dumps escapes a lone surrogate
                    r = c.post(url + route, content=json.dumps(body), headers={"content-type": "application/json"})
                    ok = r.status_code == status and r.json()["error"]["param"] == param
                    seen.append("ok" if ok else f"{route} {body} -> {r.status_code} {r.text[:300]}")

        def guarded() -> None:
            try:
                bad_client()
            except BaseException as e:  # reported below
                seen.append(f"the bad client failed: {type(e).__name__} {e}")

        thread = threading.Thread(target=guarded)
        thread.start()
        bad = mismatches(model, url, _others())
        thread.join(120)
    assert not bad, "\n".join(bad)
    running = [s for s in seen if s.startswith("running after")]
    assert running and int(running[0].split()[-1]) >= 3, seen  # the failures happened while the others ran
    assert [s for s in seen if s != "ok" and not s.startswith("running after")] == [], seen
    assert len(seen) == len(failing) + 1 + len(BAD) + len(MORE_BAD)


@pytest.mark.parametrize("field, value", [("top_p", 1e-300), ("top_p", 0), ("top_p", 2.0), ("temperature", -0.5),
                                          ("top_k", "3"), ("seed", 1.5), ("stop", [""]), ("stop", "\ud800"),
                                          ("ignore_eos", "yes"), ("stop_token_ids", [-3])])
def test_the_door_refuses_what_sampling_params_refuses_in_its_words(model, field, value):
    """The server's 400 for a sampling field is SamplingParams's refusal, word for word; a value that
    SamplingParams takes is not refused at the door."""
    want = _refusal(**{field: value})
    with serving(model) as url:
        r = httpx.post(url + "/completions", content=json.dumps({"prompt": "x", "max_tokens": 1, field: value}),
                       headers={"Content-Type": "application/json"}, timeout=60)
    if want is None:
        assert r.status_code != 400, r.text
    else:
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (400, field, want)

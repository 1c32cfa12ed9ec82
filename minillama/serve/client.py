"""The client side of the OpenAI API, as minillama's checks read it: one request sent (streamed or not) and
its choices folded into answers (token ids or token texts, log-probs, text, finish reason).

One home for the reading of a server's answer, shared by `serve`'s identity run (identity.py), the serve
bench's load generator (loadgen.py) and `minillama oracle load` (oracle/load.py). A token is its id where
the server names tokens `token_id:N` (`return_tokens_as_token_ids`, as minillama serve and vLLM do), its
text otherwise (llama-cpp-python's server).
"""

from __future__ import annotations

import json
from typing import Any

from ..refusal import error_in_answer


class Refused(Exception):
    """The server answered with an HTTP error, or a stream ended without its `[DONE]`."""


def token(name: str) -> int | str:
    """A token as a server names it in `logprobs`: its id for `token_id:N`, else its text."""
    return int(name[9:]) if name.startswith("token_id:") and name[9:].isdigit() else name


def empty_answer() -> dict[str, Any]:
    return {"tokens": [], "lps": [], "text": "", "finish": None}


def fold(got: dict[str, Any], choice: dict[str, Any], chat: bool = False) -> None:
    """Add one choice, or one streamed chunk of it, to the answer `got` (`empty_answer()` to start)."""
    lp = choice.get("logprobs") or {}
    if chat:
        got["tokens"] += [token(e["token"]) for e in lp.get("content") or []]
        got["lps"] += [e["logprob"] for e in lp.get("content") or []]
        got["text"] += (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    else:
        got["tokens"] += [token(t) for t in lp.get("tokens") or []]
        got["lps"] += lp.get("token_logprobs") or []
        got["text"] += choice.get("text") or ""
    got["finish"] = choice.get("finish_reason") or got["finish"]


def ask(client: Any, url: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request (an httpx.Client) to `url + route`; per choice its answer (`fold`). A refusal (an
    HTTP status other than 200) or a stream cut short raises `Refused`; httpx raises its own errors."""
    chat, n = route == "/chat/completions", body.get("n", 1)
    got = [empty_answer() for _ in range(n)]
    if not body.get("stream"):
        r = client.post(url + route, json=body)
        if r.status_code != 200:
            raise Refused(f"HTTP {r.status_code}: {' '.join(r.text.split())[:300]}")
        seen = _fold_all(got, r.text, chat)
    else:
        with client.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                raise Refused(f"HTTP {r.status_code}: {' '.join(r.read().decode(errors='replace').split())[:300]}")
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            raise Refused(f"the stream ended without [DONE]: {lines[-3:]}")
        seen = set().union(*(_fold_all(got, line, chat, stream=True) for line in lines[:-1]))
    missing = [i for i in range(n) if i not in seen]  # an answer of no choice is no answer, not an empty one
    if missing:
        raise Refused(f"a malformed answer (no choice of index {missing[0]})")
    return got


def _fold_all(got: list[dict[str, Any]], text: str, chat: bool, stream: bool = False) -> set[int]:
    """Fold every choice of one answer (or streamed chunk) into `got`, and return their indices; an answer of
    another shape than the API's (a server's own) raises `Refused` naming it, not an error of the reading."""
    try:
        payload = json.loads(text)
        refused = error_in_answer(payload)
        if refused is not None:
            raise Refused(refused)
        choices = payload.get("choices", []) if stream else payload["choices"]
        seen = set()
        for c in choices:
            i = c.get("index", 0)
            if not (isinstance(i, int) and 0 <= i < len(got)):
                raise ValueError(f"choice index {i!r} of {len(got)}")
            had = len(got[i]["lps"])
            fold(got[i], c, chat)
            if not all(x is None or type(x) in (int, float) for x in got[i]["lps"][had:]):  # bool is no log-prob
                raise ValueError(f"log-probs that are not numbers: {got[i]['lps'][had:][:5]}")
            seen.add(i)
        return seen
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        raise Refused(f"a malformed answer ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None

"""How a server of the OpenAI API says no, read alike by minillama's two clients of it: the oracle's
(oracle/server.py, the standard library's urllib) and serve's checks' (serve/client.py, httpx). Neither
imports the other; both import this.

A refusal is a JSON body whose `error` is an object with a `message` (or any value, said as it is). Some
servers send one with HTTP 200, where an answer was expected: a client that read it as an answer would meet
no choices and call the answer malformed, hiding what the server said.
"""

from __future__ import annotations

from typing import Any


def said(body: Any) -> str:
    """What a server's body says, one line of at most 300 characters: its error's message where it holds one,
    else the body itself."""
    if isinstance(body, dict):
        err = body.get("error", body)
        body = err.get("message", err) if isinstance(err, dict) else err
    return " ".join(str(body).split())[:300]


def error_in_answer(body: Any) -> str | None:
    """`an error in an answer of HTTP 200: MESSAGE` where a body of HTTP 200 is a refusal; None for an answer."""
    if isinstance(body, dict) and body.get("error") is not None:
        return f"an error in an answer of HTTP 200: {said(body)}"
    return None

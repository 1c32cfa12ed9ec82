"""A backend behind an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp's servers, TGI, ...).

Such a server gives no logits rows, only log-probabilities, through the completions endpoint:

    POST {url}/completions  {"prompt": [token ids], "max_tokens": 1, "temperature": 0, "echo": true,
                             "logprobs": k}

With `echo`, the answer lists every prompt token with its log-probability given the tokens before it
(`token_logprobs`) and the k most likely tokens at that position (`top_logprobs`, keyed by token text). So
one request per question teacher-forces minillama's answer: the prompt is the question's prompt followed
by the reference's answer, and the last `steps` echoed entries (before the `usage.completion_tokens`
generated ones) are the server's log-probabilities of the reference's answer tokens, each on the
reference's context. The echo must hold one entry per token sent, or the answer is refused: one entry more
or less would set each log-prob beside another token. Two exceptions: a leading BOS left out of the echo, as
some servers do (nothing before it gives it a log-prob), and an echo that leaves out other tokens (special
ones) whose last entries before the generated ones are named by the texts of the reference's answer tokens
(`_answer_ends_echo`): read from the end, with a note. The answer read is the choice of index 0.

Servers that take no token ids (llama-cpp-python's server accepts strings only) get the prompt as text,
decoded with the reference's tokenizer; the server's token count (`usage.prompt_tokens`, and the echo's
length) must then equal the reference's, or the comparison is refused: it would compare other tokens. Where
the server gives no `usage.prompt_tokens` and its echo lacks the BOS, nothing tells a dropped BOS from a
tokenizer that made one token fewer: the report says the count could not be checked. A server that returns
no prompt log-probabilities cannot be compared, and the error says so.

Only the standard library speaks HTTP here: the oracle needs no client package.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Sequence

import torch

from ..errors import BadInput
from ..refusal import error_in_answer, said
from .backends import BACKENDS, Backend, BackendError
from .schema import is_number



def base_url(url: str) -> str:
    """--url without its trailing slashes, where it is an http(s) URL with a host (and a port, if any, that
    parses) and no space; else one line naming it (BadInput)."""
    url = url.rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as e:
        raise BadInput(f"--url {url}: not a URL ({e})") from None
    if any(c.isspace() for c in url):
        raise BadInput(f"--url {url!r}: not a URL (it holds a space)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"--url {url}: not an http:// or https:// URL (e.g. http://127.0.0.1:8000/v1)")
    return url


MAX_TIMEOUT_S = 10**7  # about 116 days; a socket's timeout past a time_t overflowed (1e10 s)


def seconds(text: str) -> float:
    """--timeout: a number of seconds above 0 (argparse's type; NaN and inf are no limit a socket takes)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and at most {MAX_TIMEOUT_S:,}")
    return value


def first_model(got: Any, url: str, status: str, option: str) -> str:
    """The name of the first model a server's `/models` answer lists (`data[0].id`): a name is a string, not
    empty; a null or a number there is the server's malformed answer, named in one line, not sent on as a
    model's name. `option` is the command line's way to name the model instead."""
    try:
        name = got["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise BackendError(f"{url}/models: no model listed ({status}); give the server's model name with "
                           f"{option}") from None
    if not (isinstance(name, str) and name):
        raise BackendError(f"{url}/models: a malformed answer: data[0].id is {json.dumps(name)[:50]}, not a "
                           f"model's name; give the server's model name with {option}")
    return name


class OpenAIBackend(Backend):
    """An OpenAI-compatible server at `url` (ending in /v1), teacher-forced through prompt log-probs.

    `decode` (token ids -> text) and `vocab` (token id -> its text alone) come from the reference's tokenizer:
    the first for servers that take text prompts only, the second to name the server's top-k tokens by id.
    `bos` (the model's BOS id) is the one token a server may leave out of its echo, where a prompt starts with it.
    """

    name = "openai"

    def __init__(self, url: str, model: str | None = None, top_k: int = 5, timeout: float = 120.0,
                 decode: Callable[[Sequence[int]], str] | None = None, vocab: Sequence[str] | None = None,
                 bos: int | None = None):
        self.url = url.rstrip("/")
        self.bos = bos
        self.timeout = timeout
        self.top_k = top_k
        self.decode = decode
        self.text_prompts = False  # set once the server refuses token ids
        self.names_ids = True  # top-k named "token_id:N" (return_tokens_as_token_ids) until the server refuses it
        self.model = model or self._first_model()
        self.vocab = vocab
        self.ids_of_text = _unique_texts(vocab) if vocab is not None else {}

    def describe(self) -> str:
        how = "prompts as text" if self.text_prompts else "prompts as token ids"
        return f"OpenAI-compatible server {self.url} (model {self.model!r}, {how}, echoed prompt log-probs)"

    # -- HTTP ------------------------------------------------------------------------------------------

    def _request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text
        except (urllib.error.URLError, OSError) as e:
            if isinstance(getattr(e, "reason", e), TimeoutError):  # connected, or not, and no answer came
                raise BackendError(f"{self.url}{path}: no answer within {self.timeout:g} s (--timeout)") from None
            raise BackendError(f"{self.url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
        except http.client.HTTPException as e:  # not HTTP, or a body shorter than its Content-Length
            raise BackendError(f"{self.url}{path}: the server's answer is not HTTP ({type(e).__name__})") from None
        except (ValueError, RecursionError):
            raise BackendError(f"{self.url}{path}: the server's answer is not JSON") from None

    def _first_model(self) -> str:
        status, got = self._request("/models")
        return first_model(got, self.url, f"HTTP {status}", "--backend-model")

    def _post(self, body: dict[str, Any]) -> tuple[int, Any]:
        """POST /completions, asking for the top-k tokens by id (vLLM and minillama serve take
        `return_tokens_as_token_ids`; a text may belong to several tokens), unless the server refused that once;
        a server that ignores it names them by text, as it would anyway."""
        if self.names_ids:
            status, got = self._request("/completions", {**body, "return_tokens_as_token_ids": True})
            if status == 200 or "return_tokens_as_token_ids" not in said(got):
                return status, got
            self.names_ids = False
        return self._request("/completions", body)

    def _complete(self, ids: list[int]) -> dict[str, Any]:
        body = {"model": self.model, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": self.top_k}
        if not self.text_prompts:
            status, got = self._post({**body, "prompt": ids})
            if status == 200:
                return got
            if self.decode is None:
                raise BackendError(f"{self.url}/completions: HTTP {status}: {said(got)}")
            # Some servers refuse token ids (and some say so with HTTP 500): try the text they decode to.
            first = f"HTTP {status}: {said(got)}"
            status, got = self._post({**body, "prompt": self.decode(ids)})
            if status != 200:
                raise BackendError(f"{self.url}/completions: with token ids {first}; with text HTTP {status}: "
                                   f"{said(got)}")
            self.text_prompts = True
            return got
        status, got = self._post({**body, "prompt": self.decode(ids)})
        if status != 200:
            raise BackendError(f"{self.url}/completions: HTTP {status}: {said(got)}")
        return got

    # -- the oracle's question ---------------------------------------------------------------------------

    def teacher_force(self, prompt: Sequence[int], answer: Sequence[int]):
        from .record import QuestionRecord

        ids, steps = list(prompt) + list(answer), len(answer)
        choice, token_lps, tops, usage = _fields(self._complete(ids), f"{self.url}/completions")
        if not token_lps:
            raise BackendError(f"{self.url}: the server returned no prompt log-probs (echo + logprobs): a "
                               "teacher-forced comparison needs them")
        counted = usage.get("prompt_tokens")
        if self.text_prompts and counted not in (None, len(ids)):
            raise BackendError(f"{self.url}: the server takes no token ids, and its tokenizer made "
                               f"{counted} tokens of the prompt's text where the reference has "
                               f"{len(ids)}: it would compare other tokens")
        generated = usage.get("completion_tokens")
        if generated is None:
            generated = 0 if choice.get("finish_reason") == "stop" else 1
        end = len(token_lps) - generated  # the echoed prompt's entries, before the generated ones
        # A server may leave a leading BOS out of its echo (nothing before it gives it a log-prob): exactly
        # that is read. Any other count, one entry more or less, would set each log-prob beside another token.
        no_bos = end == len(ids) - 1 and self.bos is not None and ids[0] == self.bos
        notes = []
        if not (end == len(ids) or no_bos) or generated < 0:
            if generated < 0 or not self._answer_ends_echo(choice, end, answer):
                other = ", the prompt sent as text: its tokenizer made other tokens" if self.text_prompts else ""
                raise BackendError(f"{self.url}: {len(token_lps)} echoed log-probs ({generated} generated) for a "
                                   f"prompt and answer of {len(ids)} tokens{other}")
            notes.append(f"the server echoed {end} entries for the {len(ids)} tokens sent (its echo leaves some "
                         f"out); the answer's {steps} were found at the echo's end by their texts")
        if self.text_prompts and counted is None and no_bos:  # a tokenizer that made one token fewer reads alike
            notes.append(f"the server sent no usage.prompt_tokens and echoed the prompt's text without its BOS: "
                         f"that its tokenizer made the reference's {len(ids)} tokens of it could not be checked")
        chosen = token_lps[end - steps:end]  # log p(answer token s | prompt, answer[:s])
        if any(x is None for x in chosen):
            raise BackendError(f"{self.url}: the server gave no log-prob for some answer tokens")
        top_ids = torch.full((steps, self.top_k), -1, dtype=torch.int64)
        top_lps = torch.full((steps, self.top_k), float("-inf"))
        top_texts: list[list[str]] = []
        for s, entry in enumerate((tops or [None] * len(token_lps))[end - steps:end]):
            best = sorted((entry or {}).items(), key=lambda kv: -kv[1])[:self.top_k]
            top_texts.append([t for t, _ in best])
            for j, (text, value) in enumerate(best):
                top_lps[s, j], top_ids[s, j] = value, _id_of(text, self.ids_of_text, self.url)
        q = QuestionRecord(list(prompt), list(answer), logprobs=torch.tensor(chosen, dtype=torch.float32),
                           notes=notes)
        if tops:
            q.top_ids, q.top_logprobs, q.top_texts = top_ids, top_lps, top_texts
        return q

    def logits(self, ids: Sequence[int], positions: torch.Tensor | None = None) -> torch.Tensor:
        raise BackendError(f"{self.name}: a server gives log-probs, not logits rows")

    def _answer_ends_echo(self, choice: dict, end: int, answer: Sequence[int]) -> bool:
        """Whether the echo's entries just before the generated ones are the answer's tokens, by the texts the
        server names them with (`logprobs.tokens`) and the reference's: how an echo that leaves tokens out (a
        server whose echo skips special tokens) is still read, where the count alone cannot place it."""
        texts = (choice.get("logprobs") or {}).get("tokens")
        if self.vocab is None or not isinstance(texts, list) or not len(answer) <= end <= len(texts):
            return False
        return all(0 <= i < len(self.vocab) and t in (self.vocab[i], f"token_id:{i}")
                   for t, i in zip(texts[end - len(answer):end], answer))


def _fields(got: Any, where: str) -> tuple[dict, list, list | None, dict]:
    """A completion's choice of index 0 (the one asked for), its echoed log-probs, their top log-probs and its
    usage, each checked to be of the type read (a server's answer is its own: a wrong shape is named in one
    line, not met as a crash)."""
    choices = got.get("choices") if isinstance(got, dict) else None
    refused = error_in_answer(got)
    if refused is not None:
        raise BackendError(f"{where}: {refused}")
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        raise BackendError(f"{where}: no choices in the answer (a list of objects)")
    # The API numbers each choice; its place in the list is no promise. Choices without their number, or
    # two of one number, cannot say which is the answer asked for.
    indexes = [c.get("index") for c in choices]
    if not (all(type(i) is int for i in indexes) and len(set(indexes)) == len(indexes) and 0 in indexes):
        raise BackendError(f"{where}: a malformed answer: choices must each have their own integer index, one "
                           f"of them 0 (got indexes {json.dumps(indexes)[:80]})")
    choice, usage = choices[indexes.index(0)], got.get("usage") or {}
    lp = choice.get("logprobs") or {}
    token_lps, tops = (lp.get("token_logprobs"), lp.get("top_logprobs")) if isinstance(lp, dict) else (None, None)
    checks = [(isinstance(lp, dict), "choices[0].logprobs must be an object"),
              (token_lps is None or (isinstance(token_lps, list) and all(x is None or is_number(x) for x in token_lps)),
               "logprobs.token_logprobs must be a list of numbers"),
              (tops is None or (isinstance(tops, list) and all(
                  t is None or (isinstance(t, dict) and all(isinstance(k, str) and is_number(v) for k, v in t.items()))
                  for t in tops)), "logprobs.top_logprobs must be a list of objects of numbers"),
              (isinstance(usage, dict) and all(usage.get(k) is None
                                               or (isinstance(usage[k], int) and is_number(usage[k]))
                                               for k in ("prompt_tokens", "completion_tokens")),
               "usage must be an object of integer token counts"),
              (not tops or not isinstance(token_lps, list) or len(tops) == len(token_lps),
               f"logprobs.top_logprobs and token_logprobs differ in length ({len(tops or [])} and "
               f"{len(token_lps or [])})")]
    bad = next((why for ok, why in checks if not ok), None)
    if bad is not None:
        raise BackendError(f"{where}: a malformed answer: {bad}")
    return choice, token_lps, tops, usage


def _id_of(text: str, ids_of_text: dict[str, int], url: str) -> int:
    """A top-k key's token id: vLLM names tokens "token_id:N" when asked (return_tokens_as_token_ids);
    others by text, which only a text that belongs to one token identifies. -1: unknown."""
    if text.startswith("token_id:") and text[9:].isascii() and text[9:].isdigit():  # "²" is a digit int() refuses
        if int(text[9:]) >= 2**31:
            raise BackendError(f"{url}: the server's top log-probs name {text}, past any vocabulary")
        return int(text[9:])
    return ids_of_text.get(text, -1)


def _unique_texts(vocab: Sequence[str]) -> dict[str, int]:
    """Token text -> id, for texts that belong to exactly one token (servers key top-k by text)."""
    seen: dict[str, int] = {}
    for i, text in enumerate(vocab):
        seen[text] = -1 if text in seen else i
    return {t: i for t, i in seen.items() if i >= 0 and t}


BACKENDS["openai"] = OpenAIBackend

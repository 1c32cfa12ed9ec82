"""The OpenAI request schema: checking a request's fields, and writing answers and their log-probs.

Each bad field is refused with HTTP 400 and a message that names it (`BadRequest.param`); nothing is
clamped, truncated or ignored silently: a field minillama does not implement is refused when it asks for
something (a non-zero penalty, a logit bias), and accepted when it asks for the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .. import api
from ..generate import SamplingParams

MAX_TOP_LOGPROBS = 20
# Fields that change sampling in ways minillama does not implement, and the value that asks for nothing.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
               "suffix": None, "tools": None, "response_format": None, "min_tokens": 0}


class BadRequest(Exception):
    """A request that cannot be served as given: HTTP `status` (400 unless said), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    context: int  # the model's context length
    vocab: int
    max_tokens: int  # the most new tokens one choice may ask for
    max_n: int = 16
    max_prompts: int = 64


@dataclass
class Job:
    """A checked request: what to run and how to answer."""

    chat: bool
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    stop: tuple[str, ...]
    top_k: int = 0  # top log-probs per token
    logprobs: bool = False
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    ids_as_tokens: bool = False  # name tokens "token_id:N" (as vLLM's return_tokens_as_token_ids)
    model: str = ""
    prompt_texts: list[str] = field(default_factory=list)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"{name} must be {span}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise BadRequest("stop must be a string or a list of at most 16 strings", "stop")
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty", "stop")
    return tuple(stops)


def _token_ids(ids: list, limits: Limits, where: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{where} must be a string or a list of integer token ids", "prompt")
    bad = [t for t in ids if not 0 <= t < limits.vocab]
    if bad:
        raise BadRequest(f"{where}: token id {bad[0]} is outside 0 .. {limits.vocab - 1}", "prompt")
    return list(ids)


def _prompts(body: dict, tokenizer: Any, limits: Limits) -> tuple[list[list[int]], list[str]]:
    p = body.get("prompt")
    if p is None:
        raise BadRequest("prompt is required", "prompt", code="missing_required_parameter")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise BadRequest("prompt must be a string, a list of token ids, or a list of those", "prompt")
    if len(p) > limits.max_prompts:
        raise BadRequest(f"prompt: at most {limits.max_prompts} prompts per request, got {len(p)}", "prompt")
    ids, texts = [], []
    for i, x in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{i}]"
        if isinstance(x, str):
            got = tokenizer.encode(x, add_special=True, parse_special=False)
            texts.append(x)
        elif isinstance(x, list):
            got = _token_ids(x, limits, where)
            texts.append(tokenizer.decode(got))
        else:
            raise BadRequest(f"{where} must be a string or a list of integer token ids", "prompt")
        if not got:
            raise BadRequest(f"{where} is empty", "prompt")
        ids.append(got)
    return ids, texts


def _messages(body: dict, tokenizer: Any) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        turns.append({"role": m["role"], "content": content})
    if tokenizer.chat_template is None:
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.encode_chat(turns, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
        raise BadRequest(f"messages: the chat template refused them ({e})", "messages") from None


def parse(body: Any, chat: bool, tokenizer: Any, limits: Limits, model_name: str) -> Job:
    """Check a /v1/completions (chat False) or /v1/chat/completions body; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    model = body.get("model", model_name)
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} does not exist; this server has {model_name!r}", "model", 404,
                         "model_not_found")
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (default, None, {}, []) and not (name == "response_format"
                                                               and body[name] == {"type": "text"}):
            raise BadRequest(f"{name} is not supported by minillama serve", name, code="unsupported")
    n = _int(body, "n", 1, 1, limits.max_n)
    if body.get("best_of") not in (None, n):
        raise BadRequest("best_of is not supported (it must equal n)", "best_of", code="unsupported")
    if chat:
        prompts, texts = [_messages(body, tokenizer)], []
        logprobs = _bool(body, "logprobs")
        top_k = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top_k and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        echo = False
    else:
        prompts, texts = _prompts(body, tokenizer, limits)
        k = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        logprobs, top_k = k is not None, k or 0
        echo = _bool(body, "echo")
    longest = max(len(p) for p in prompts)
    if longest >= limits.context:
        raise BadRequest(f"{'messages' if chat else 'prompt'}: {longest} tokens, the model's context is "
                         f"{limits.context}", "messages" if chat else "prompt", code="context_length_exceeded")
    room = limits.context - longest
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    default = min(room, limits.max_tokens) if chat else 16
    max_tokens = _int(body, name, default, 0, limits.max_tokens)
    if max_tokens > room:
        raise BadRequest(f"{name}: {longest} prompt tokens + {max_tokens} new ones exceed the model's context "
                         f"({limits.context})", name, code="context_length_exceeded")
    temperature = _num(body, "temperature", 1.0)
    top_p = _num(body, "top_p", 1.0)
    top_k_sampling = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", 0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    stop = _stop(body)
    params = api.sampling_params(max_tokens, temperature, max(top_k_sampling, 0), top_p, seed,
                                 _bool(body, "ignore_eos"), stop, tokenizer)
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be {\"include_usage\": true|false}", "stream_options")
    return Job(chat=chat, prompts=prompts, n=n, params=params, stop=stop, top_k=top_k, logprobs=logprobs,
               echo=echo, stream=_bool(body, "stream"), include_usage=bool((opts or {}).get("include_usage")),
               ids_as_tokens=_bool(body, "return_tokens_as_token_ids"), model=model_name, prompt_texts=texts)


# --- answers --------------------------------------------------------------------------------------


class Text:
    """A choice's text as its tokens arrive: only what can no longer change is released (an incomplete
    UTF-8 character or the start of a stop string waits), and the end is `api.answer_text`'s cut."""

    def __init__(self, tokenizer: Any, stop_ids: set[int], stop: Sequence[str]):
        self.tok, self.stop_ids, self.stop = tokenizer, stop_ids, tuple(stop)
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int | None, final: bool) -> str:
        if token is not None:
            self.ids.append(token)
        if final:
            text = api.answer_text(self.tok, self.ids, self.stop_ids, self.stop)
        else:
            text = self.tok.decode(self.ids).rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def token_name(tokenizer: Any, token: int, ids_as_tokens: bool) -> str:
    return f"token_id:{token}" if ids_as_tokens else tokenizer.decode([token])


def completion_logprobs(tokenizer: Any, tokens: Sequence[int], lps: Sequence[float | None],
                        tops: Sequence[Sequence[tuple[int, float]]], job: Job, offset: int = 0) -> dict[str, Any]:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs (text -> log-prob)
    and text_offset, for `tokens` with their log-probs."""
    names = [token_name(tokenizer, t, job.ids_as_tokens) for t in tokens]
    offsets = []
    for name in names:
        offsets.append(offset)
        offset += len(name)
    top = None
    if job.top_k:
        top = [None if lp is None else {token_name(tokenizer, i, job.ids_as_tokens): v for i, v in t}
               for lp, t in zip(lps, tops)]
    return {"tokens": names, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, tokens: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]], job: Job) -> dict[str, Any]:
    """The chat API's logprobs object: one entry per token, with its top_logprobs."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        name = token_name(tokenizer, t, job.ids_as_tokens)
        return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, lp, top in zip(tokens, lps, tops)]}

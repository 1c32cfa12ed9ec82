"""The OpenAI request schema: checking a request's fields (answers and their log-probs: answers.py).

Each bad field is refused with HTTP 400 and a message that names it (`BadRequest.param`); nothing is
clamped, truncated or ignored silently: which fields exist, and which are refused when they ask for
something, is fields.py's table; an unknown field is refused too. The sampling fields are checked by
their rows of the option table (`checks.check_options`), so the server refuses, in the same words,
exactly what `minillama generate` and the Python API refuse: every check a sampled row needs happens
here, before the request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .. import api
from ..checks import check_options, fewest_tokens
from ..options import is_finite, text
from ..errors import BadInput
from ..generate import SamplingParams
from ..tokenizer.base import MARK_CHARS, TokenizerError, Uncontinuable
from .fields import refusal
from .logits import RowFilter, row_filter

MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16
# A message's roles (OpenAI's, less the tool and function calls this server refuses).
ROLES = ("system", "developer", "user", "assistant")


class BadRequest(Exception):
    """A request that cannot be served as given: HTTP `status` (400 unless said), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_value",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers

    def body(self) -> dict[str, Any]:
        # OpenAI's types: a rate limit on requests is type "requests" (code "rate_limit_exceeded").
        kind = "requests" if self.status == 429 else "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": _safe(str(self), 500), "type": kind,
                          "param": None if self.param is None else _safe(self.param, 100), "code": self.code}}


def _safe(text: str, most: int) -> str:
    """Text a JSON answer can carry: a client's lone surrogate (in a field's name) escaped, at most `most`
    characters (a number of 4,000 digits is named by its start)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= most else text[:most - 3] + "..."


@dataclass
class Limits:
    context: int  # the model's context length
    vocab: int
    max_tokens: int  # the most new tokens one choice may ask for
    max_n: int = 16
    max_prompts: int = 64
    max_sequences: int | None = None  # the engine's queue (--max-queue): one request's prompts x n at most


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
    include_stop: bool = False  # include_stop_str_in_output: the stop string / stop token stays in the text
    skip_special: bool = False  # skip_special_tokens: control tokens are left out of the text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the prompt's log-probs with this top-k
    logits_filter: RowFilter | None = None  # min_p, allowed_token_ids (logits.py)
    echo_text: str = ""  # chat echo: the final assistant message the answer continues

    @property
    def prompt_rows(self) -> bool:
        """Whether each choice needs its prompt's own log-probs (echo with logprobs, or prompt_logprobs)."""
        return (self.echo and self.logprobs) or self.prompt_logprobs is not None


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
    if not isinstance(v, (int, float)) or not is_finite(v):
        raise BadRequest(f"{name} must be a finite number, got {v!r}"[:300], name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> Any:
    v = body.get("stop")
    if isinstance(v, list) and len(v) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} stop strings, got {len(v)}", "stop")
    return () if v is None else v


def _sampling(tokenizer: Any, skip_special: bool, **fields: tuple[str, Any]) -> SamplingParams:
    """SamplingParams from the request's fields (SamplingParams field -> (the request's name, value)), each
    checked by its row of the option table, so the refusal is the API's, naming the request's field; its stop
    strings sought in the text as written (`skip_special`: control tokens left out)."""
    for name, (asked, value) in fields.items():
        try:
            check_options(spell=lambda _, asked=asked: asked, **{name: value})
        except BadInput as e:
            raise BadRequest(str(e), asked) from None
    return SamplingParams(**{name: value for name, (_, value) in fields.items()}).with_tokenizer(tokenizer, skip_special)


def _ids(body: dict, name: str, limits: Limits) -> list[int] | None:
    """A field that is a list of token ids in the vocabulary, or None."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BadRequest(f"{name} must be a list of integer token ids, got {v!r}"[:300], name)
    bad = [t for t in v if not 0 <= t < limits.vocab]
    if bad:
        raise BadRequest(f"{name}: token id {bad[0]} is outside 0 .. {limits.vocab - 1}", name)
    return v


def _token_ids(ids: list, limits: Limits, where: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{where} must be a string or a list of integer token ids", "prompt")
    bad = [t for t in ids if not 0 <= t < limits.vocab]
    if bad:
        raise BadRequest(f"{where}: token id {bad[0]} is outside 0 .. {limits.vocab - 1}", "prompt")
    return list(ids)


def _text(value: str, where: str, param: str) -> None:
    """Refuse a string that is not text (a lone surrogate: `options.text`)."""
    try:
        text(value, where)
    except BadInput as e:
        raise BadRequest(str(e), param) from None


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
            _text(x, where, "prompt")
            _fits(tokenizer, x, limits, "prompt")
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


def _fits(tokenizer: Any, text: str, limits: Limits, param: str) -> None:
    """Refuse a text too long for the context before tokenizing it: a megabyte's tokenizing held the other
    clients' streams for a second."""
    least = fewest_tokens(tokenizer, text)
    if least >= limits.context:
        raise BadRequest(f"{param}: at least {least} tokens ({len(text)} characters), the model's context is "
                         f"{limits.context}", param, code="context_length_exceeded")


def _messages(body: dict, tokenizer: Any, limits: Limits) -> tuple[list[int], str]:
    """The chat's prompt ids, and (with echo) the final assistant message the answer continues."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}"[:300],
                             "messages")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content", "name") and v is not None)
        if extra:  # tool_calls, ...: asked for and not done (a null is not asking)
            raise BadRequest(f"messages[{i}]: {extra[0]!r} is not supported (role, content and name are)",
                             "messages", code="unsupported")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise BadRequest(f"messages[{i}].name must be a string", "messages")
        if m.get("name"):  # written by a template as its own text, it must not spell a control token
            _text(m["name"], f"messages[{i}].name", "messages")
            if tokenizer.spells_control(m["name"]):
                raise BadRequest(f"messages[{i}].name must not spell a control token", "messages")
            if MARK_CHARS.search(m["name"]):  # what marks where message text goes in a render
                raise BadRequest(f"messages[{i}].name must not hold U+E000 or U+E001", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       and all(v is None for k, v in c.items() if k not in ("type", "text")) for c in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported",
                                 "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        _text(content, f"messages[{i}].content", "messages")
        # a name goes to the template, as HF's templates take it (most write none of it)
        turns.append({"role": m["role"], "content": content, **({"name": m["name"]} if m.get("name") else {})})
    if tokenizer.chat_template is None:
        raise BadRequest("this model has no chat template: use /v1/completions", "messages")
    _fits(tokenizer, "".join(t["content"] for t in turns), limits, "messages")  # the template writes them all
    try:  # a template that drops or cuts a message's content would lose the client's text
        api.template_parts(tokenizer)
    except TokenizerError:  # it refused the probe's chat, one user turn (it asks for a system turn first, ...):
        pass  # this request's own chat is rendered, and checked, below
    except BadInput:
        raise BadRequest(f"messages: this model's chat template ({getattr(tokenizer, 'template_source', '')}) "
                         "does not write a message's content as given: use /v1/completions", "messages") from None
    generation = _bool(body, "add_generation_prompt", True)
    if _bool(body, "continue_final_message"):
        if generation:
            raise BadRequest("continue_final_message needs add_generation_prompt: false (the answer continues "
                             "the final message instead of starting a new one)", "continue_final_message")
        ids = _continued(turns, tokenizer)
    else:
        try:
            ids = tokenizer.encode_chat(turns, add_generation_prompt=generation)
        except Exception as e:  # the template's own raise_exception (e.g. roles out of order)
            raise BadRequest(f"messages: the chat template refused them ({e})", "messages") from None
    echo = _bool(body, "echo") and turns[-1]["role"] == "assistant"
    return ids, turns[-1]["content"] if echo else ""


def _continued(turns: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """continue_final_message: the chat rendered up to the end of its final message's text, with nothing
    after it (no end of turn), as HF transformers cuts it, but where the template writes that message
    (`Tokenizer.continued_chat`), not at the text's last occurrence, which may be in the template's trailer."""
    final = turns[-1]["content"]
    if not final.strip():
        raise BadRequest("continue_final_message: the final message is empty", "continue_final_message")
    if any(tokenizer.spells_control(m["content"]) for m in turns):  # as written, or as NFKC leaves it
        raise BadRequest("continue_final_message: messages that spell control tokens are not supported with it",
                         "continue_final_message")
    try:
        text = tokenizer.continued_chat(turns)
    except Uncontinuable:  # the template's own refusal (raise_exception, an undefined name) is said below
        raise BadRequest("continue_final_message: the chat template does not write the final message's text "
                         "as given", "continue_final_message") from None
    except Exception as e:
        raise BadRequest(f"messages: the chat template refused them ({e})", "messages") from None
    return tokenizer.encode(text)


def parse(body: Any, chat: bool, tokenizer: Any, limits: Limits, model_name: str) -> Job:
    """Check a /v1/completions (chat False) or /v1/chat/completions body; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    refused = refusal(body, chat)
    if refused is not None:
        message, name, code = refused
        raise BadRequest(message, name, code=code)
    model = body.get("model", model_name)
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string (the served model's name)", "model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} does not exist; this server has {model_name!r}", "model", 404,
                         "model_not_found")
    n = _int(body, "n", 1, 1, limits.max_n)
    if not (body.get("best_of") is None or _is(body["best_of"], n)):  # True is no 1, 2.0 no 2
        raise BadRequest("best_of is not supported (it must equal n)", "best_of", code="unsupported")
    echo_text = ""
    if chat:
        prompt, echo_text = _messages(body, tokenizer, limits)
        prompts, texts = [prompt], []
        logprobs = _bool(body, "logprobs")
        top_k = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top_k and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        echo = False  # chat's echo is the final message's text (echo_text), not the prompt's tokens
    else:
        prompts, texts = _prompts(body, tokenizer, limits)
        k = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        logprobs, top_k = k is not None, k or 0
        echo = _bool(body, "echo")
    if limits.max_sequences is not None and len(prompts) * n > limits.max_sequences:
        raise BadRequest(f"{len(prompts)} prompts x n {n} = {len(prompts) * n} sequences; the server queues at most "
                         f"{limits.max_sequences} (--max-queue): send fewer prompts or a smaller n", "n")
    longest = max(len(p) for p in prompts)
    if longest >= limits.context:
        raise BadRequest(f"{'messages' if chat else 'prompt'}: {longest} tokens, the model's context is "
                         f"{limits.context}", "messages" if chat else "prompt", code="context_length_exceeded")
    room = limits.context - longest
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
        # each checked as when given alone ("4", true, 4.0 are no integer) before they are compared
        tokens_given, completion_given = _int(body, "max_tokens", None), _int(body, name, None)
        if tokens_given is not None and tokens_given != completion_given:
            raise BadRequest(f"max_tokens ({tokens_given}) and max_completion_tokens ({completion_given}) differ: "
                             "give one of them"[:300], "max_completion_tokens")
    default = min(room, limits.max_tokens) if chat else 16
    max_tokens = _int(body, name, default, 0, limits.max_tokens)
    if max_tokens > room:
        raise BadRequest(f"{name}: {longest} prompt tokens + {max_tokens} new ones exceed the model's context "
                         f"({limits.context})", name, code="context_length_exceeded")
    top_k_sampling = body.get("top_k")
    skip_special = _bool(body, "skip_special_tokens", False)
    params = _sampling(tokenizer, skip_special, max_new_tokens=(name, max_tokens),
                       temperature=("temperature", _default(body, "temperature", 1.0)),
                       top_k=("top_k", 0 if top_k_sampling is None or _is(top_k_sampling, -1) else top_k_sampling),
                       top_p=("top_p", _default(body, "top_p", 1.0)), seed=("seed", _default(body, "seed", 0)),
                       ignore_eos=("ignore_eos", _default(body, "ignore_eos", False)),
                       stop_token_ids=("stop_token_ids", _default(body, "stop_token_ids", ())),
                       stop=("stop", _stop(body)))
    _ids(body, "stop_token_ids", limits)  # past the option table's check: also in the vocabulary
    min_p = _num(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise BadRequest(f"min_p must be in [0, 1] (0: off), got {min_p}", "min_p")
    allowed = _ids(body, "allowed_token_ids", limits)
    if allowed is not None and not allowed:
        raise BadRequest("allowed_token_ids must not be empty (no token could be chosen)", "allowed_token_ids")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}
                                 and isinstance(opts.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be {\"include_usage\": true|false}", "stream_options")
    if opts is not None and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if stream and body.get("prompt_logprobs") is not None:
        raise BadRequest("prompt_logprobs are not available with stream: true", "prompt_logprobs")
    return Job(chat=chat, prompts=prompts, n=n, params=params, stop=params.stop_strings, top_k=top_k,
               logprobs=logprobs, echo=echo, stream=stream, include_usage=bool((opts or {}).get("include_usage")),
               ids_as_tokens=_bool(body, "return_tokens_as_token_ids"), model=model_name, prompt_texts=texts,
               include_stop=_bool(body, "include_stop_str_in_output"),
               skip_special=skip_special,
               prompt_logprobs=_int(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS),
               logits_filter=row_filter(limits.vocab, params.temperature, min_p, allowed), echo_text=echo_text)


def _is(value: Any, integer: int) -> bool:
    """`value` is that integer, not a float or a bool equal to it (vLLM's top_k of -1: off; -1.0 is refused)."""
    return type(value) is int and value == integer


def _default(body: dict, name: str, default: Any) -> Any:
    """The field's value, or its default when absent or null (the option table checks the value)."""
    v = body.get(name)
    return default if v is None else v

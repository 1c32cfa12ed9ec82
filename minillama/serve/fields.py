"""Every request field `minillama serve` knows, and what it does with each: the one table of them.

A field is *implemented* (schema.py reads and checks it), a *label* (it names or tags the request and
asks nothing of the answer: accepted, no effect), or *refused*: minillama does not do what it asks, so a
request that asks for it is HTTP 400 naming the field; only the values that ask for nothing (a zero
penalty, no tools) are accepted. A field in no row, a misspelt `max_token` included, is HTTP 400 too:
nothing a client sends is ignored silently. docs/serve.md's field table is this table in words
(tests/test_serve_fields.py checks that they agree).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

BOTH, COMPLETIONS, CHAT = ("completions", "chat"), ("completions",), ("chat",)


@dataclass(frozen=True)
class Field:
    kind: str  # "implemented", "label" or "refused"
    routes: tuple[str, ...] = BOTH
    neutral: tuple[Any, ...] = ()  # refused: the values that ask for nothing (None always does)


def _implemented(routes: tuple[str, ...] = BOTH) -> Field:
    return Field("implemented", routes)


def _refused(*neutral: Any, routes: tuple[str, ...] = BOTH) -> Field:
    return Field("refused", routes, neutral)


FIELDS: dict[str, Field] = {
    # OpenAI's fields
    "model": _implemented(), "prompt": _implemented(COMPLETIONS), "messages": _implemented(CHAT),
    "max_tokens": _implemented(), "max_completion_tokens": _implemented(CHAT), "n": _implemented(),
    "best_of": _implemented(COMPLETIONS),  # equal to n: one sample per choice
    "temperature": _implemented(), "top_p": _implemented(), "seed": _implemented(), "stop": _implemented(),
    "stream": _implemented(), "stream_options": _implemented(), "logprobs": _implemented(),
    "top_logprobs": _implemented(CHAT), "echo": _implemented(),
    "user": Field("label"), "metadata": Field("label", CHAT),
    "frequency_penalty": _refused(0), "presence_penalty": _refused(0), "logit_bias": _refused({}),
    "suffix": _refused("", routes=COMPLETIONS), "response_format": _refused({"type": "text"}),
    "tools": _refused([], routes=CHAT), "tool_choice": _refused("none", routes=CHAT),
    "parallel_tool_calls": _refused(routes=CHAT), "functions": _refused([], routes=CHAT),
    "function_call": _refused("none", routes=CHAT), "store": _refused(False, routes=CHAT),
    "service_tier": _refused("auto", "default"), "modalities": _refused(["text"], routes=CHAT),
    "audio": _refused(routes=CHAT), "prediction": _refused(routes=CHAT),
    "reasoning_effort": _refused(routes=CHAT), "web_search_options": _refused(routes=CHAT),
    # vLLM's extra fields
    "top_k": _implemented(), "min_p": _implemented(), "ignore_eos": _implemented(),
    "stop_token_ids": _implemented(), "include_stop_str_in_output": _implemented(),
    "skip_special_tokens": _implemented(), "prompt_logprobs": _implemented(),
    "allowed_token_ids": _implemented(), "return_tokens_as_token_ids": _implemented(),
    "add_generation_prompt": _implemented(CHAT), "continue_final_message": _implemented(CHAT),
    "request_id": Field("label"),
    "repetition_penalty": _refused(1), "length_penalty": _refused(1), "typical_p": _refused(1),
    "min_tokens": _refused(0), "use_beam_search": _refused(False), "bad_words": _refused([]),
    "truncate_prompt_tokens": _refused(), "spaces_between_special_tokens": _refused(True),
    "add_special_tokens": _refused(), "logits_processors": _refused([]), "priority": _refused(0),
    "guided_json": _refused(), "guided_regex": _refused(), "guided_choice": _refused(),
    "guided_grammar": _refused(), "guided_decoding_backend": _refused(), "guided_whitespace_pattern": _refused(),
    "structural_tag": _refused(), "chat_template": _refused(routes=CHAT),
    "chat_template_kwargs": _refused({}, routes=CHAT), "documents": _refused([], routes=CHAT),
    "mm_processor_kwargs": _refused({}, routes=CHAT),
}


def refusal(body: dict[str, Any], chat: bool) -> tuple[str, str, str] | None:
    """(message, field, error code) for the first field of `body` that is unknown on this route, or refused
    and asking for something; None when every field may be read (schema.parse raises it as HTTP 400)."""
    route = "chat" if chat else "completions"
    known = [name for name, f in FIELDS.items() if route in f.routes]
    for name, value in body.items():
        f = FIELDS.get(name)
        if f is None or route not in f.routes:
            where = "" if f is None else f" on /v1/{'chat/' if chat else ''}completions"
            like = difflib.get_close_matches(name, known, n=1) if f is None else []
            hint = f" (did you mean {like[0]!r}?)" if like else ""
            return f"{name}: unknown field{where}{hint}", name, "unknown_field"
        if f.kind == "refused" and value is not None and not any(_same(value, v) for v in f.neutral):
            return f"{name} is not supported by minillama serve (refused rather than ignored)", name, "unsupported"
    return None


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind (`false` is not the penalty 0)."""
    number = (int, float)
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(value, number) and isinstance(neutral, number):
        return value == neutral
    return type(value) is type(neutral) and value == neutral

"""What the server answers: a choice's text as its tokens arrive (`Text`, holding back what a stop string
may still cut) and the log-probs of the completions and chat APIs, each token named by its text, or by its
bytes where it holds part of a character, with `text_offset` counted in the choice's text.
"""

from __future__ import annotations

import codecs
from typing import Any, Sequence

from .. import api
from ..tokenizer.base import decoded_after
from .schema import Job


class Text:
    """A choice's text as its tokens arrive: only what can no longer change is released (an incomplete
    UTF-8 character or the start of a stop string waits), and the end is `api.answer_text`'s cut. The text
    decoded so far is kept where it is whole, and only the tokens since are decoded (`decoded_after`): a
    long stream costs each token a few tokens' decoding, not the whole answer's."""

    def __init__(self, tokenizer: Any, stop_ids: set[int], stop: Sequence[str], include_stop: bool = False,
                 skip_special: bool = False):
        self.tok, self.stop_ids, self.stop = tokenizer, stop_ids, tuple(stop)
        self.include_stop, self.skip_special = include_stop, skip_special
        self.ids: list[int] = []
        self.sent = ""
        self.known, self.upto = "", 0  # the text of ids[:upto], which ends in a whole character

    def push(self, token: int | None, final: bool) -> str:
        if token is not None:
            self.ids.append(token)
        if final:
            text = api.answer_text(self.tok, self.ids, self.stop_ids, self.stop, self.include_stop, self.skip_special)
        else:
            text = self.known + decoded_after(self.tok, self.ids, self.upto, self.skip_special)
            if not text.endswith("\ufffd"):
                self.known, self.upto = text, len(self.ids)
            text = text.rstrip("\ufffd")
            text = text[:len(text) - max((starts(text, s) for s in self.stop), default=0)]
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def starts(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is the start of `stop`, shorter than `stop` (what must
    wait: the stop string may be starting). Compared only where `stop`'s first character is in text's last
    len(stop) - 1 characters, from the first such place (the longest): at most len(stop) places of at most
    len(stop) characters, in C (MAX_STOP_CHARS bounds both), where testing every length sliced `stop` for
    each."""
    tail = text[max(0, len(text) - len(stop) + 1):] if len(stop) > 1 else ""
    at = tail.find(stop[:1])
    while at >= 0:
        if stop.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(stop[:1], at + 1)
    return 0


def token_name(tokenizer: Any, token: int, ids_as_tokens: bool) -> str:
    """How the log-probs name a token: its text (`Tokenizer.token_bytes`); "bytes:\\xe6\\x97" where its bytes
    are part of a character, as OpenAI's API names them (by their text alone two such tokens were both
    U+FFFD, and `top_logprobs`, keyed by name, lost one); "token_id:N" with return_tokens_as_token_ids."""
    return f"token_id:{token}" if ids_as_tokens else _named(tokenizer.token_bytes(token))


def _named(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _utf8_so_far(data: bytes) -> str:
    """`data` decoded as a stream decodes it: an incomplete character at the end left out, not a U+FFFD."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data)


class Offsets:
    """text_offset: where each token's text starts in the choice's text, in characters, counted on as the
    tokens arrive (a stream's chunks go on where the last one ended, as the whole answer counts), from `at`
    (an echoed prompt's length, before the answer). Counted as the text decodes (`decoded_after`), so a
    sentencepiece word at the text's start (or after a control token) adds no space and a skipped control
    token nothing; the tokens of a character split over several start where it does, and bytes that make
    no character count as the U+FFFD the text shows for them. The text is taken as whole wherever the
    tokens' bytes (`Tokenizer.token_bytes`) leave no character incomplete."""

    def __init__(self, tokenizer: Any, skip_special: bool = False, at: int = 0):
        self.tok, self.skip_special, self.base = tokenizer, skip_special, at  # base: where ids[:upto] end
        self.ids: list[int] = []
        self.upto, self.since = 0, ""  # the tokens since ids[:upto] end in part of a character; their text
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # which bytes are still incomplete

    def take(self, tokens: Sequence[int]) -> list[int]:
        """The offsets of `tokens`, the next ones of the text."""
        out = []
        for t in tokens:
            data = self.tok.token_bytes(t)
            pending = self._utf8.getstate()[0]  # the bytes of the character the text ends in part of
            joins = bool(data) and "\ufffd" not in _utf8_so_far(pending + data[:1])
            if pending and not joins:  # that character is over, a U+FFFD for good (a lead byte, then another):
                self.base, self.upto, self.since = self.base + len(self.since), len(self.ids), ""  # as decoded
            # a token that goes on with it starts where it does (its U+FFFDs not counted), another at the end
            out.append(self.base + len(self.since.rstrip("\ufffd") if pending and joins else self.since))
            self.ids.append(t)
            self._utf8.decode(data)
            self.since = decoded_after(self.tok, self.ids, self.upto, self.skip_special)
            if not self._utf8.getstate()[0]:  # no character left incomplete: what is decoded stays
                self.base, self.upto, self.since = self.base + len(self.since), len(self.ids), ""
        return out


def prompt_offsets(tokenizer: Any, prompt: Sequence[int], text: str) -> list[int]:
    """text_offset of an echoed prompt's tokens in its `text`: as the prompt decodes, or, where the text
    lacks the control tokens the tokenizer added (BOS), as it decodes without them; none past the text's end."""
    skip = tokenizer.decode(prompt) != text
    return [min(a, len(text)) for a in Offsets(tokenizer, skip).take(prompt)]


def completion_logprobs(tokenizer: Any, tokens: Sequence[int], lps: Sequence[float | None],
                        tops: Sequence[Sequence[tuple[int, float]]], job: Job, at: list[int]) -> dict[str, Any]:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs (name -> log-prob: the
    likelier where two tokens share a name) and text_offset (`at`: `Offsets`), for `tokens` with their log-probs."""
    top = None
    if job.top_k:
        top = [None if lp is None else _first_of_each(tokenizer, t, job.ids_as_tokens) for lp, t in zip(lps, tops)]
    return {"tokens": [token_name(tokenizer, t, job.ids_as_tokens) for t in tokens], "token_logprobs": list(lps),
            "top_logprobs": top, "text_offset": at}


def _first_of_each(tokenizer: Any, top: Sequence[tuple[int, float]], ids_as_tokens: bool) -> dict[str, float]:
    named: dict[str, float] = {}
    for i, v in top:  # likeliest first
        named.setdefault(token_name(tokenizer, i, ids_as_tokens), v)
    return named


def prompt_logprobs(tokenizer: Any, prompt: Sequence[int], lps: Sequence[tuple[float | None, int | None, list]],
                    k: int, ids_as_tokens: bool) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the top `k` at its position."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, (lp, rank, top) in zip(prompt[1:], lps[1:]):
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_name(tokenizer, t, ids_as_tokens)}}
        for r, (i, v) in enumerate(top[:k], 1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": token_name(tokenizer, i, ids_as_tokens)})
        out.append(entry)
    return out


def chat_logprobs(tokenizer: Any, tokens: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]], job: Job) -> dict[str, Any]:
    """The chat API's logprobs object: one entry per token, with its top_logprobs."""
    def entry(t: int, lp: float) -> dict[str, Any]:
        if job.ids_as_tokens:
            name = f"token_id:{t}"
            return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}
        raw = tokenizer.token_bytes(t)  # the token's own bytes, whole characters or part of one
        return {"token": _named(raw), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, lp, top in zip(tokens, lps, tops)]}

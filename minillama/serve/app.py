"""The HTTP layer: an ASGI app (starlette) with the OpenAI routes, over one Engine.

    POST /v1/completions        prompt (text or token ids), echo, logprobs, stream, n, stop, seed, ...
    POST /v1/chat/completions   messages through the model's chat template; logprobs / top_logprobs
    GET  /v1/models             the one model served; GET /v1/models/{id} that model
    GET  /health                200 and the engine's counters while it serves, 503 otherwise

Requests are checked (schema.py) before they reach the engine, so a bad one is a 400 that touches nothing
the others use. Each choice is one engine `Choice`; its events cross from the engine thread to the event
loop through an asyncio queue. A client that goes away (mid-stream or while waiting) has its sequences
cancelled, which frees their slots at the engine's next step. Every error, an unknown route or method
included, is an OpenAI `{"error": {...}}` body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import LoadedModel
from ..inputs import RepeatedKey, once_each
from .engine import Choice, Engine, Event, QueueFull, Stopped
from .answers import Offsets, Text, chat_logprobs, completion_logprobs, prompt_logprobs, prompt_offsets
from .schema import BadRequest, Job, Limits, parse

RETRY_AFTER_S = 1  # what a 429 (a full queue) asks the client to wait
CLOSE = {"Connection": "close"}  # a body left unread: the connection cannot carry another request


def error(e: BadRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Choices:
    """The sequences of one request and what each has produced so far."""

    def __init__(self, app_state: "State", job: Job):
        self.state, self.job = app_state, job
        tok = app_state.model.tokenizer
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.seqs: list[Choice] = []
        self.texts: list[Text] = []
        for p in job.prompts:
            for j in range(job.n):
                i = len(self.seqs)
                emit: Callable[[Event], None] = lambda ev, i=i: loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
                self.seqs.append(Choice(list(p), job.params, emit, index=j, top_k=job.top_k,
                                          echo=job.prompt_rows, prompt_top_k=_prompt_top_k(job),
                                          logits_filter=job.logits_filter))
                self.texts.append(Text(tok, app_state.stop_ids(job), job.stop, job.include_stop, job.skip_special))
        # text_offset, carried from chunk to chunk; an answer's starts after its echoed prompt
        self.offsets = [Offsets(tok, job.skip_special, len(job.prompt_texts[i // job.n]) if job.echo else 0)
                        for i in range(len(self.seqs))]
        self.tokens: list[list[int]] = [[] for _ in self.seqs]
        self.lps: list[list[float]] = [[] for _ in self.seqs]
        self.tops: list[list[list[tuple[int, float]]]] = [[] for _ in self.seqs]
        self.prompt_lps: list[Any] = [None] * len(self.seqs)
        self.finish: list[str | None] = [None] * len(self.seqs)
        self.open = len(self.seqs)

    def record(self, i: int, ev: Event) -> None:
        if ev.error is not None:
            if "shutting down" in ev.error:  # as a request the stopping engine refuses (`_serve`)
                raise BadRequest(ev.error, None, 503, "shutting_down")
            raise BadRequest(ev.error, None, 500, "server_error")
        if ev.prompt_logprobs is not None:
            self.prompt_lps[i] = ev.prompt_logprobs
        if ev.token is not None:
            self.tokens[i].append(ev.token)
            self.lps[i].append(ev.logprob)
            self.tops[i].append(ev.top or [])
        if ev.finish_reason is not None:
            self.finish[i] = ev.finish_reason
            self.open -= 1

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        done = sum(len(t) for t in self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def cancel(self) -> None:
        self.state.engine.cancel([s for s, f in zip(self.seqs, self.finish) if f is None])


class State:
    def __init__(self, model: LoadedModel, engine: Engine, name: str, limits: Limits, api_key: str | None):
        self.model, self.engine, self.name, self.limits, self.api_key = model, engine, name, limits, api_key
        self.created = int(time.time())
        self.eos = set(engine.eos)

    def stop_ids(self, job: Job) -> set[int]:
        """The tokens that end a choice (as `generate`'s questions stop): its stop_token_ids, and EOS."""
        return set(job.params.stop_token_ids) | (set() if job.params.ignore_eos else self.eos)


def _prompt_top_k(job: Job) -> int:
    return max(job.top_k if job.echo and job.logprobs else 0, job.prompt_logprobs or 0)


def build_app(model: LoadedModel, engine: Engine, name: str, max_tokens: int = 4096, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, start_engine: bool = True) -> Starlette:
    """The ASGI app. The engine is stopped with the app (its lifespan), and started with it in a thread of its
    own unless `start_engine` is False: then the caller runs `engine.run()` (the command line, on its main
    thread)."""
    limits = Limits(model.context_length, model.llama.config.vocab_size, max_tokens, max_sequences=engine.max_queue)
    state = State(model, engine, name, limits, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    def authorized(request: Request) -> bool:
        if state.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme's name is case-insensitive (RFC 9110: "bearer" is "Bearer"); the key is not
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), state.api_key.encode())

    async def health(request: Request) -> Response:
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "unavailable", **engine.stats()},
                            status_code=200 if alive else 503)

    card = {"id": name, "object": "model", "created": state.created, "owned_by": "minillama",
            "max_model_len": limits.context}

    async def models(request: Request) -> Response:
        if not authorized(request):
            return error(BadRequest("invalid or missing API key", None, 401, "invalid_api_key"))
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:
        if not authorized(request):
            return error(BadRequest("invalid or missing API key", None, 401, "invalid_api_key"))
        asked = request.path_params["model"]
        if asked != name:
            return error(BadRequest(f"model {asked!r} does not exist; this server has {name!r}", "model", 404,
                                    "model_not_found"))
        return JSONResponse(card)

    async def http_error(request: Request, e: HTTPException) -> Response:
        """An unknown route (404) or method (405), in the API's error shape."""
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error(BadRequest(what.get(e.status_code, str(e.detail)), None, e.status_code, code, e.headers))

    async def completions(request: Request) -> Response:
        return await _serve(request, state, chat=False, max_body=max_body_bytes, authorized=authorized)

    async def chat(request: Request) -> Response:
        return await _serve(request, state, chat=True, max_body=max_body_bytes, authorized=authorized)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/v1/models/{model:path}", model),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.minillama = state
    return app


async def _read_json(request: Request, max_body: int) -> Any:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body:
        raise BadRequest(f"body: {size} bytes, the limit is {max_body} (--max-body)", "body", 413, "too_large",
                         CLOSE)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_body:
            raise BadRequest(f"body: more than {max_body} bytes (--max-body)", "body", 413, "too_large", CLOSE)
    try:
        return json.loads(data, object_pairs_hook=once_each)  # a field given twice: refused, not the last taken
    except RepeatedKey as e:
        raise BadRequest(f"body: {e}", "body") from None
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"body: not JSON ({e})", "body") from None


async def _serve(request: Request, state: State, chat: bool, max_body: int, authorized) -> Response:
    try:
        if not authorized(request):
            raise BadRequest("invalid or missing API key", None, 401, "invalid_api_key")
        body = await _read_json(request, max_body)
        job = await asyncio.to_thread(parse, body, chat, state.model.tokenizer, state.limits, state.name)
        choices = _Choices(state, job)
        try:
            state.engine.submit(choices.seqs)
        except QueueFull as e:
            raise BadRequest(str(e), None, 429, "rate_limit_exceeded", {"Retry-After": str(RETRY_AFTER_S)}) from None
        except Stopped as e:
            raise BadRequest(str(e), None, 503, "shutting_down") from None
    except BadRequest as e:
        return error(e)
    except ClientDisconnect:  # gone before its body was whole: nobody to answer, nothing to log
        return Response(status_code=499)
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if job.stream:
        return _Stream(_events(choices, rid), on_close=choices.cancel)
    watch = asyncio.create_task(_disconnected(request))
    try:
        while choices.open:
            get = asyncio.create_task(choices.queue.get())
            await asyncio.wait([get, watch], return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                choices.cancel()
                return Response(status_code=499)  # nobody is there to read it
            choices.record(*get.result())
    except BadRequest as e:
        return error(e)
    finally:
        watch.cancel()
        choices.cancel()
    return JSONResponse(_whole(choices, rid))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Stream(StreamingResponse):
    """Server-sent events; `on_close` runs however the stream ends (finished, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _head(choices: _Choices, rid: str) -> dict[str, Any]:
    kind = "chat.completion" if choices.job.chat else "text_completion"
    return {"id": rid, "object": kind + ("" if not choices.job.stream or not choices.job.chat else ".chunk"),
            "created": int(time.time()), "model": choices.job.model}


def _echo_part(choices: _Choices, i: int) -> tuple[str, list[int], list[float | None], list[list], list[int]]:
    """Echo: the prompt's text, tokens, log-probs (None for the first), top-k and text offsets, before the answer."""
    job = choices.job
    p, text = job.prompts[i // job.n], job.prompt_texts[i // job.n]
    plp = choices.prompt_lps[i] or [(None, None, [])] * len(p)
    at = prompt_offsets(choices.state.model.tokenizer, p, text) if job.logprobs else []
    return text, list(p), [x for x, _, _ in plp], [t[:job.top_k] for _, _, t in plp], at


def _prompt_logprobs(choices: _Choices, i: int) -> list[Any] | None:
    """vLLM's prompt_logprobs of choice i, or None when not asked for."""
    job = choices.job
    if job.prompt_logprobs is None:
        return None
    return prompt_logprobs(choices.state.model.tokenizer, job.prompts[i // job.n], choices.prompt_lps[i],
                           job.prompt_logprobs, job.ids_as_tokens)


def _whole(choices: _Choices, rid: str) -> dict[str, Any]:
    job, tok = choices.job, choices.state.model.tokenizer
    out = []
    for i in range(len(choices.seqs)):
        text = choices.texts[i]
        for t in choices.tokens[i]:
            text.ids.append(t)
        answer = text.push(None, final=True)
        if job.chat:
            c: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": job.echo_text + answer},
                                 "logprobs": None, "finish_reason": choices.finish[i]}
            if job.logprobs:
                c["logprobs"] = chat_logprobs(tok, choices.tokens[i], choices.lps[i], choices.tops[i], job)
        else:
            toks, lps, tops = choices.tokens[i], list(choices.lps[i]), choices.tops[i]
            at = choices.offsets[i].take(toks) if job.logprobs else []
            if job.echo:
                ptext, ptoks, plps, ptops, pat = _echo_part(choices, i)
                answer, toks, lps, tops, at = ptext + answer, ptoks + toks, plps + lps, ptops + tops, pat + at
            c = {"index": i, "text": answer, "logprobs": None, "finish_reason": choices.finish[i]}
            if job.logprobs:
                c["logprobs"] = completion_logprobs(tok, toks, lps, tops, job, at)
            if job.prompt_logprobs is not None:
                c["prompt_logprobs"] = _prompt_logprobs(choices, i)
        out.append(c)
    whole = {**_head(choices, rid), "choices": out, "usage": choices.usage()}
    if job.chat and job.prompt_logprobs is not None:  # one prompt: the first choice's (each choice's is the same)
        whole["prompt_logprobs"] = _prompt_logprobs(choices, 0)
    return whole


async def _events(choices: _Choices, rid: str) -> AsyncIterator[str]:
    """The stream: one chunk per event of any choice, then (with include_usage) the usage, then [DONE]."""
    job, tok = choices.job, choices.state.model.tokenizer
    if job.chat:
        for i in range(len(choices.seqs)):
            first = {"index": i, "delta": {"role": "assistant", "content": job.echo_text}, "logprobs": None,
                     "finish_reason": None}
            yield _sse({**_head(choices, rid), "choices": [first]})
    started = [False] * len(choices.seqs)
    try:
        while choices.open:
            i, ev = await choices.queue.get()
            choices.record(i, ev)
            delta = choices.texts[i].push(ev.token, final=ev.finish_reason is not None)
            toks = [ev.token] if ev.token is not None else []
            lps, tops = ([ev.logprob], [ev.top or []]) if toks else ([], [])
            if job.chat:
                c: dict[str, Any] = {"index": i, "delta": {"content": delta} if delta else {},
                                     "logprobs": chat_logprobs(tok, toks, lps, tops, job) if job.logprobs else None,
                                     "finish_reason": ev.finish_reason}
            else:
                at = choices.offsets[i].take(toks) if job.logprobs else []
                if job.echo and not started[i]:
                    ptext, ptoks, plps, ptops, pat = _echo_part(choices, i)
                    delta, toks, lps, tops, at = ptext + delta, ptoks + toks, plps + lps, ptops + tops, pat + at
                c = {"index": i, "text": delta, "finish_reason": ev.finish_reason,
                     "logprobs": completion_logprobs(tok, toks, lps, tops, job, at) if job.logprobs else None}
            started[i] = True
            yield _sse({**_head(choices, rid), "choices": [c]})
    except BadRequest as e:
        yield _sse(e.body())
        return
    if job.include_usage:
        yield _sse({**_head(choices, rid), "choices": [], "usage": choices.usage()})
    yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"

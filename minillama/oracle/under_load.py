"""`minillama oracle load`: does an OpenAI-compatible server give a request the same answer whatever else it
is serving? The serve identity run's method (serve/identity.py), pointed at any endpoint.

Each of N probe requests is sent five times, and each answer (tokens, log-probs, text, finish reason) is
compared with `==` against the probe's answer **alone** (sent with nothing else in flight, its prompt seen
once before). Each other run changes one thing, so each comparison names one cause:

    cold       the first send, nothing of its prompt cached        prefix cache:     cold vs alone
    alone      the second send, alone                               (the reference)
    again      the third send, alone, as the second                 run-to-run:       again vs alone
    streamed   the fourth send, alone, streamed                     streaming:        streamed vs alone
    load       in random order and at random times, from C clients  batch dependence: load vs alone
               beside other requests of mixed lengths, some sharing
               a probe's prefix, some a common head, some neither

A probe's prompt starts with tokens no other probe of the run starts with, so its first send finds
nothing of it cached (unless an earlier run with the same `seed` sent it); the sends after it find the
whole prompt seen. Prompts are token ids where the server takes them
(ids 32..255, ordinary tokens in every byte-level and SentencePiece vocabulary of the Llama family), text
otherwise; greedy or seeded sampling (where two sends with one seed agree: the server honours `seed`);
log-probs where the server offers them (`logprobs: 1`, tokens named by id where it honours
`return_tokens_as_token_ids`). The requests go through the serve tools' client (serve/client.py).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import BadInput
from ..serve.client import Refused, ask
from .backends import BackendError
from .server import base_url, first_model

ID_LOW, ID_HIGH = 32, 256
WORDS = ("the river bridge opened engineer steel road tracks long metres north city works year built design "
         "water light stone tower station people train market old new small large early late under over "
         "across between before after because while where which quiet bright heavy narrow").split()
SPREAD_S = 0.1  # a request of the load phase waits up to this long after its client is free
# cause -> (its name in the report, the run compared with the alone run)
CAUSES = {"batch": ("batch dependence", "load"), "run_to_run": ("run-to-run", "again"),
          "prefix_cache": ("prefix cache", "cold"), "streaming": ("streaming", "streamed")}
WHAT = {"batch": "under load vs alone", "run_to_run": "alone again vs alone", "prefix_cache": "cold vs prefix-cached",
        "streaming": "streamed vs not"}


@dataclass
class Server:
    """What the server at `url` takes and gives, found by asking it (`probe_server`)."""

    url: str
    model: str
    ids: bool = False  # takes token-id prompts
    logprobs: bool = False  # answers with `logprobs: 1`
    token_ids: bool = False  # names its tokens by id (`return_tokens_as_token_ids`)
    seed: bool = False  # two sampled sends with one seed agree
    extras: dict[str, Any] = field(default_factory=dict)  # what every request carries

    def describe(self) -> str:
        return (f"{self.url}, model {self.model!r} (prompts as {'token ids' if self.ids else 'text'}, "
                f"{'log-probs' if self.logprobs else 'no log-probs'}, tokens named by "
                f"{'id' if self.token_ids else 'text'}, seed {'honoured' if self.seed else 'not honoured'})")


def _client(timeout: float = 600.0, clients: int = 1) -> Any:
    try:
        import httpx
    except ImportError:
        raise BadInput("minillama oracle load needs httpx: pip install httpx") from None
    return httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=clients + 4))


def _try(client: Any, url: str, body: dict[str, Any]) -> list[dict[str, Any]] | str:
    """One request's answers, or why it got none (a refusal, a connection error) as text."""
    import httpx

    try:
        return ask(client, url, "/completions", body)
    except Refused as e:
        return str(e)
    except httpx.TimeoutException:
        return f"no answer within {client.timeout.read:g} s (--timeout)"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def probe_server(client: Any, url: str, model: str | None, prompts: str = "auto") -> Server:
    """The served model's name (`model`, or the first `/models` lists) and what the server takes and gives."""
    import httpx

    if model is None:
        try:
            r = client.get(url + "/models")
            got = r.json()
        except httpx.TimeoutException:
            raise BackendError(f"{url}/models: no answer within {client.timeout.read:g} s (--timeout)") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise BackendError(f"{url}: cannot reach the server ({type(e).__name__}: {e})") from None
        except (ValueError, RecursionError):  # not JSON
            got = None
        model = first_model(got, url, f"HTTP {r.status_code}", "--model")
    rng = random.Random(12345)
    ids = [rng.randrange(ID_LOW, ID_HIGH) for _ in range(12)]
    kinds = {"auto": [True, False], "ids": [True], "text": [False]}[prompts]
    why = []
    for as_ids in kinds:
        for extras in ({"logprobs": 1, "return_tokens_as_token_ids": True}, {"logprobs": 1}, {}):
            body = {"model": model, "prompt": ids if as_ids else " ".join(WORDS[:12]), "max_tokens": 2,
                    "temperature": 0, **extras}
            got = _try(client, url, body)
            if isinstance(got, str):
                why.append(got)
                continue
            s = Server(url, model, ids=as_ids, logprobs=bool(got[0]["lps"]), extras=extras,
                       token_ids=any(isinstance(t, int) for t in got[0]["tokens"]))
            sampled = {**body, "temperature": 1.0, "seed": 4321, "max_tokens": 8}
            pair = [_try(client, url, sampled) for _ in range(2)]
            # the tokens alone: log-probs that move from run to run are the run-to-run comparison's to find
            s.seed = not isinstance(pair[0], str) and not isinstance(pair[1], str) and \
                [(a["tokens"], a["text"]) for a in pair[0]] == [(a["tokens"], a["text"]) for a in pair[1]]
            return s
    raise BackendError(f"{url}/completions: every form of a one-token request was refused ({why[-1]})")


def _prompt(rng: random.Random, server: Server, lead: int, length: int) -> list[int] | str:
    """A prompt of `length` tokens (ids) or words (text) whose start no other probe shares (`lead`)."""
    if server.ids:
        return [ID_LOW + lead // (ID_HIGH - ID_LOW) % (ID_HIGH - ID_LOW), ID_LOW + lead % (ID_HIGH - ID_LOW)] + \
            [rng.randrange(ID_LOW, ID_HIGH) for _ in range(length)]
    return f"{lead}. " + " ".join(rng.choice(WORDS) for _ in range(length))


def _tail(rng: random.Random, server: Server, length: int) -> list[int] | str:
    return [rng.randrange(ID_LOW, ID_HIGH) for _ in range(length)] if server.ids else \
        " " + " ".join(rng.choice(WORDS) for _ in range(length))


def _body(rng: random.Random, server: Server, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": rng.randint(1, max_tokens), "temperature": 0,
            **server.extras}
    if server.seed and rng.random() < 0.5:
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(10**6))
    return body


def workload(rng: random.Random, server: Server, n: int, max_tokens: int) -> tuple[list[dict], list[dict]]:
    """n probes, and n // 2 (at least 4) other requests for the load phase: a probe's prefix with another tail,
    one of four common heads with a tail, or a prompt of their own, a third each; streamed or not."""
    first = rng.randrange(10**4)  # probes of runs with other seeds start elsewhere too
    probes = [_body(rng, server, _prompt(rng, server, first + i, rng.randint(2, 60)), max_tokens) for i in range(n)]
    heads = [_prompt(rng, server, first + n + h, rng.randint(30, 80)) for h in range(4)]
    others = []
    for _ in range(max(4, n // 2)):
        kind = rng.choice(["probe", "head", "own"])
        if kind == "probe":
            p = rng.choice(probes)["prompt"]  # ids or text: cut anywhere
            prompt = p[:rng.randint(1, len(p))]
        else:
            prompt = rng.choice(heads) if kind == "head" else _prompt(rng, server, rng.randrange(10**6), 0)
        body = _body(rng, server, prompt + _tail(rng, server, rng.randint(1, 40)), max_tokens)
        others.append({**body, "stream": rng.random() < 0.5})
    return probes, others


def differ(ref: Any, got: Any) -> dict[str, Any] | None:
    """None when two answers are identical (tokens, log-probs, text, finish reason); else the first step
    that differs (token or log-prob), the largest log-prob gap before the tokens part, whether the tokens
    changed (the text, where the server gives no tokens) and, for a request that got no answer, why."""
    if isinstance(ref, str) or isinstance(got, str):
        return {"first_step": None, "logprob_gap": None, "tokens_changed": None,
                "error": ref if isinstance(ref, str) else got}
    if ref == got:
        return None
    ta, tb, la, lb = ref["tokens"], got["tokens"], ref["lps"], got["lps"]
    same = next((s for s, (a, b) in enumerate(zip(ta, tb)) if a != b), min(len(ta), len(tb)))
    gaps = [abs(a - b) for a, b in zip(la[:same], lb[:same]) if a is not None and b is not None]
    first = next((s for s in range(same) if s < len(la) and s < len(lb) and la[s] != lb[s]), None)
    if first is None and (ta or tb) and (ta != tb):
        first = same
    changed = ta != tb if (ta or tb) else ref["text"] != got["text"]
    return {"first_step": first, "logprob_gap": max(gaps) if gaps else None, "tokens_changed": changed,
            "error": None}


def _send_alone(client: Any, url: str, probes: list[dict], on_probe=None) -> dict[str, list]:
    """Each probe four times in a row with nothing else in flight: cold, alone, again, streamed."""
    runs: dict[str, list] = {"cold": [], "alone": [], "again": [], "streamed": []}
    for i, body in enumerate(probes):
        for run in runs:
            got = _try(client, url, {**body, "stream": run == "streamed"})
            runs[run].append(got if isinstance(got, str) else got[0])
        if on_probe is not None:
            on_probe(i)
    return runs


def _send_under_load(client: Any, url: str, probes: list[dict], others: list[dict], clients: int,
                     rng: random.Random) -> tuple[list, list[str]]:
    """Probes and other requests shuffled, from `clients` client threads, each request `delay` seconds after
    its client is free; the probes' answers, and why each of the other requests that got none got none."""
    tasks = [("probe", i, {**b, "stream": False}) for i, b in enumerate(probes)] + \
        [("other", i, b) for i, b in enumerate(others)]
    rng.shuffle(tasks)
    delays = [rng.random() * SPREAD_S for _ in tasks]

    def send(k: int) -> Any:
        time.sleep(delays[k])
        return _try(client, url, tasks[k][2])

    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(send, range(len(tasks))))
    load: list[Any] = [None] * len(probes)
    failed = []
    for (kind, i, _), got in zip(tasks, answers):
        if kind == "probe":
            load[i] = got if isinstance(got, str) else got[0]
        elif isinstance(got, str):
            failed.append(got)
    return load, failed


def summarize(runs: dict[str, list], probes: list[dict]) -> dict[str, Any]:
    """Per cause: requests compared, how many differ, in how many the tokens changed, the earliest first
    differing step, the largest log-prob gap, and each differing request."""
    out = {}
    for cause, (_, run) in CAUSES.items():
        diffs = [(i, differ(a, b)) for i, (a, b) in enumerate(zip(runs["alone"], runs[run]))]
        bad = [{"request": i, "sampled": "seed" in probes[i], **d} for i, d in diffs if d is not None]
        steps = [d["first_step"] for d in bad if d["first_step"] is not None]
        gaps = [d["logprob_gap"] for d in bad if d["logprob_gap"] is not None]
        for d in bad:  # where the cold answer differs too, an answer like it points at the prefix cache
            i = d["request"]
            cold = runs["cold"][i]
            d["like_cold"] = cause == "batch" and cold != runs["alone"][i] and runs[run][i] == cold
        out[cause] = {"compares": WHAT[cause], "requests": len(diffs), "differ": len(bad),
                      "like_cold": sum(d["like_cold"] for d in bad),
                      "tokens_changed": sum(bool(d["tokens_changed"]) for d in bad),
                      "errors": sum(d["error"] is not None for d in bad),
                      "first_step": min(steps) if steps else None, "max_logprob_gap": max(gaps) if gaps else None,
                      "differing": bad}
    return out


def run(url: str, model: str | None = None, requests: int = 200, clients: int = 16, seed: int = 0,
        max_tokens: int = 16, prompts: str = "auto", timeout: float = 600.0,
        say: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """The whole check against the server at `url` (.../v1): the result `report` reads and `--json` writes.
    `say`: where its progress goes (the command's: a terminal's stderr), a line a tenth of the probes."""
    for name, value in (("--requests", requests), ("--clients", clients), ("--max-tokens", max_tokens)):
        if value < 1:
            raise BadInput(f"{name} must be at least 1, got {value}")
    url = base_url(url)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    with _client(timeout, clients) as client:
        server = probe_server(client, url, model, prompts)
        probes, others = workload(rng, server, requests, max_tokens)
        step = max(1, len(probes) // 10)

        def sent(i: int) -> None:
            if (i + 1) % step == 0 or i + 1 == len(probes):
                say(f"  {i + 1} of {len(probes)} probes sent alone")

        say(f"{len(probes)} probes, each sent alone four times (cold, alone, again, streamed)")
        runs = _send_alone(client, url, probes, sent)
        say(f"under load: the probes among {len(others)} other requests, from {clients} clients")
        runs["load"], others_failed = _send_under_load(client, url, probes, others, clients, rng)
    causes = summarize(runs, probes)
    return {"server": {"url": url, "model": server.model, "token_id_prompts": server.ids,
                       "logprobs": server.logprobs, "tokens_named_by_id": server.token_ids,
                       "seed_honoured": server.seed, "describe": server.describe()},
            "settings": {"requests": requests, "clients": clients, "seed": seed, "max_tokens": max_tokens,
                         "sampled": sum("seed" in p for p in probes), "other_requests": len(others),
                         "other_requests_failed": len(others_failed), "other_errors": others_failed[:3]},
            "causes": causes, "identical": all(c["differ"] == 0 for c in causes.values()),
            "wall_s": round(time.perf_counter() - t0, 2),
            "probes": [{"prompt": p["prompt"], "max_tokens": p["max_tokens"], "temperature": p["temperature"],
                        "seed": p.get("seed")} for p in probes]}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def report(r: dict[str, Any]) -> str:
    """The result as a person reads it: the server, the workload, one line per cause, the verdict."""
    s = r["settings"]
    lines = [f"server    {r['server']['describe']}",
             f"workload  {s['requests']} requests ({s['requests'] - s['sampled']} greedy, {s['sampled']} seeded "
             f"sampling), 1-{s['max_tokens']} new tokens; under load beside {s['other_requests']} other requests "
             f"from {s['clients']} clients; seed {s['seed']}; {r['wall_s']:.0f} s", "",
             f"{'cause':<17} {'compares':<23} {'requests':>8} {'differ':>6} {'tokens changed':>14} "
             f"{'first step':>10} {'max|dlogprob|':>13}"]
    for cause, c in r["causes"].items():
        step = "-" if c["first_step"] is None else str(c["first_step"])
        lines.append(f"{CAUSES[cause][0]:<17} {c['compares']:<23} {c['requests']:>8} {c['differ']:>6} "
                     f"{c['tokens_changed']:>14} {step:>10} {_fmt(c['max_logprob_gap']):>13}")
        if c["errors"]:
            why = next(d["error"] for d in c["differing"] if d["error"])
            lines.append(f"{'':<17} {c['errors']} got no answer, e.g. {why}")
    like_cold = r["causes"]["batch"]["like_cold"]
    if like_cold:
        lines.append(f"note: {like_cold} of the answers that differ under load equal the cold answer, which differs "
                     "from the answer alone: the prefix cache's state under load (another prompt ran just before), "
                     "not the batch, can explain those")
    if s["other_requests_failed"]:
        lines.append(f"note: {s['other_requests_failed']} of the other requests got no answer, e.g. "
                     f"{s['other_errors'][0]}")
    if not r["server"]["logprobs"]:
        lines.append("note: the server gives no log-probs: tokens and text are compared")
    if not r["server"]["seed_honoured"]:
        lines.append("note: two sampled sends with one seed differed, or seed was refused: greedy requests only")
    bad = [f"{CAUSES[k][0]} ({c['differ']} of {c['requests']} requests, tokens changed in {c['tokens_changed']})"
           for k, c in r["causes"].items() if c["differ"]]
    lines += ["", "identical: every answer equals the answer alone, under load, again, cold and streamed"
              if not bad else "DIFFER: " + "; ".join(bad)]
    return "\n".join(lines)

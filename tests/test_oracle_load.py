"""`minillama oracle load` against a real `minillama serve` on loopback (a subprocess on a tiny checkpoint):
with the exact kernels every answer of 200 probes from 16 clients is identical alone, again, cold, streamed
and under load (exit 0); with `serve --plain-kernels`, the negative control, the batch-dependence count is
not zero, run-to-run is zero, and the report names batch dependence (exit 3). Also: text prompts, the
JSON file, minillama's reference on the greedy probes, bad input (exit 2, one line), a fault planted in
one send of a stand-in server named as its cause and no other, `generate --plain-kernels`, how one
comparison reads two answers, and a server that answers kept-alive connections without Nagle's delay
(the check's time bound depends on it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minillama import cli
from minillama.oracle.__main__ import main
from minillama.oracle.under_load import differ
from test_api import DOC, QUESTIONS
from _serve_harness import ckpt, model, serving  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent


def start_server(ckpt: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`minillama serve` on a free loopback port; its base URL from the line it prints when ready."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # tiny shapes: one thread is fastest
    out = open(log, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "minillama", "serve", "--model", str(ckpt), "--port", "0",
                             "--served-model-name", "tiny", *flags], stdout=out, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"on (http://\S+/v1)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop(proc)
    pytest.fail(f"the server did not start: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve(ckpt: Path, log: Path, *flags: str):
    proc, url = start_server(ckpt, log, *flags)
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def exact(ckpt, tmp_path_factory):
    with serve(ckpt, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def load(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["load", *map(str, args)])
    return code, capsys.readouterr().out


def check(capsys, url: str, n: int, out_json: Path) -> tuple[int, str, dict]:
    code, out = load(capsys, "--url", url, "--requests", n, "--clients", 16, "--max-tokens", 4, "--json", out_json)
    got = json.loads(out_json.read_text())
    assert got["server"]["token_id_prompts"] and got["server"]["logprobs"] and got["server"]["seed_honoured"]
    assert all(c["requests"] == n for c in got["causes"].values()) and 0 < got["settings"]["sampled"] < n
    return code, out, got


def test_every_answer_identical_with_exact_kernels(exact, tmp_path, capsys):
    """200 probes from 16 clients: alone, again, cold, streamed and under load, every answer the same."""
    code, out, got = check(capsys, exact, 200, tmp_path / "r.json")
    assert code == 0 and got["identical"], out
    assert all(c["differ"] == 0 for c in got["causes"].values()) and "identical: every answer" in out


def test_negative_control_plain_kernels_show_batch_dependence(ckpt, tmp_path, capsys):
    """`serve --plain-kernels`: answers under load differ from those alone, and only that cause is named."""
    with serve(ckpt, tmp_path / "serve.log", "--plain-kernels") as url:
        code, out, got = check(capsys, url, 40, tmp_path / "r.json")  # the control needs only to see a difference
    causes = got["causes"]
    assert code == 3 and not got["identical"] and causes["run_to_run"]["differ"] == 0, out
    batch = causes["batch"]
    assert batch["differ"] > 0 and batch["max_logprob_gap"] > 0 and batch["first_step"] is not None
    assert "DIFFER: batch dependence" in out
    assert len(batch["differing"]) == batch["differ"] and batch["differing"][0]["error"] is None


def test_text_prompts_and_minillama_reference(exact, ckpt, capsys):
    code, out = load(capsys, "--url", exact, "--requests", 12, "--clients", 4, "--prompts", "text")
    assert code == 0 and "prompts as text" in out, out
    code, out = load(capsys, "--url", exact, "--requests", 12, "--clients", 4, "--max-tokens", 4,
                     "--reference-model", ckpt)
    assert code == 0 and "minillama's reference, on the greedy probes" in out, out
    assert re.search(r"(\d+) of \1 questions pass: PASS", out), out


@pytest.mark.parametrize("args, says", [
    (["--url", "http://127.0.0.1:9/v1", "--requests", "0"], "--requests must be at least 1, got 0"),
    (["--url", "http://127.0.0.1:9/v1", "--clients", "-2"], "--clients must be at least 1, got -2"),
    (["--url", "ftp://127.0.0.1/v1"], "not an http:// or https:// URL"),
    (["--url", "http://127.0.0.1:9/v1"], "cannot reach the server"),
    (["--url", "http://127.0.0.1:9/v1", "--json", "/no/such/folder/r.json"], "does not exist"),
    (["--url", "http://[::1/v1"], "not a URL"),
    (["--url", "http://127.0.0.1:99999/v1"], "not a URL"),
    (["--url", "http://127.0.0.1:9/v1", "--json", "/proc/r.json"], "/proc/r.json: "),  # refused before any request
    (["--url", "http://127.0.0.1:9/v1", "--reference-model", "/no/such/ckpt"], "no such file or directory"),
    # read before the run (a server that is not there here), not once it has ended
    (["--url", "http://127.0.0.1:9/v1", "--reference-model", str(ROOT / "docs")], "neither an HF directory"),
    (["--url", "http://127.0.0.1:9/v1", "--timeout", "0"], "--timeout: '0' is not a number of seconds above 0"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, capsys):
    code = main(["load", *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_a_reference_that_cannot_compare_keeps_the_runs_report(ckpt, tmp_path, capsys, monkeypatch):
    """With no greedy probe, --reference-model refused once the run had ended, and its report and --json were
    lost. --json r.out was refused where r.json is a folder (export's manifest name, nothing load writes)."""
    import minillama.oracle.under_load as loadcheck

    result = {"identical": True, "probes": [{"prompt": [1, 2], "temperature": 1.0}], "server": {"model": "tiny"}}
    monkeypatch.setattr(loadcheck, "run", lambda *a: result)
    monkeypatch.setattr(loadcheck, "report", lambda r: "THE REPORT")
    (tmp_path / "r.json").mkdir()
    code = main(["load", "--url", "http://127.0.0.1:9/v1", "--reference-model", str(ckpt),
                 "--json", str(tmp_path / "r.out")])
    out, err = capsys.readouterr()
    assert code == 2 and out.strip() == "THE REPORT" and "raise --requests" in err and err.count("\n") == 1
    assert json.loads((tmp_path / "r.out").read_text())["identical"] is True


def answer(tokens, lps, text="x", finish="length"):
    return {"tokens": tokens, "lps": lps, "text": text, "finish": finish}


def test_one_comparison_names_the_first_step_the_gap_and_changed_tokens():
    a = answer([5, 6, 7], [-1.0, -2.0, -3.0])
    assert differ(a, answer([5, 6, 7], [-1.0, -2.0, -3.0])) is None
    d = differ(a, answer([5, 6, 7], [-1.0, -2.5, -3.0]))
    assert (d["first_step"], d["logprob_gap"], d["tokens_changed"]) == (1, 0.5, False)
    d = differ(a, answer([5, 9, 7], [-1.25, -2.0, -3.0]))
    assert (d["first_step"], d["logprob_gap"], d["tokens_changed"]) == (0, 0.25, True)  # gap before they part
    d = differ(a, answer([5, 9], [-1.0, -2.0]))
    assert (d["first_step"], d["logprob_gap"], d["tokens_changed"]) == (1, 0.0, True)
    d = differ(answer([], [], "a b"), answer([], [], "a c"))  # a server without log-probs: the text
    assert d["tokens_changed"] and d["first_step"] is None
    assert differ(a, "HTTP 429: busy")["error"] == "HTTP 429: busy"


@pytest.mark.parametrize("send, cause", [(1, "prefix_cache"), (3, "run_to_run"), (4, "streaming"), (5, "batch")])
def test_a_fault_in_one_send_is_named_as_its_cause_only(send, cause, monkeypatch):
    """A stand-in server whose answers are a function of the prompt, except the n-th send of each probe
    (1 cold, 2 alone, 3 again, 4 streamed, 5 under load), whose log-probs move: only that cause differs."""
    from minillama.oracle import under_load

    sends: dict[str, int] = {}

    def fake(client, url, body):
        key = repr(body["prompt"])
        sends[key] = sends.get(key, 0) + 1
        lp = -1.0 - (len(key) % 7) / 8 + (1e-3 if sends[key] == send else 0.0)
        return [{"tokens": [len(key) % 50, 7], "lps": [lp, -0.5], "text": "ab", "finish": "length"}]

    monkeypatch.setattr(under_load, "_try", fake)
    monkeypatch.setattr(under_load, "probe_server", lambda client, url, model, prompts: under_load.Server(
        url, "m", ids=True, logprobs=True, token_ids=True, seed=True))
    got = under_load.run("http://127.0.0.1:9/v1", requests=20, clients=4)
    assert {k for k, c in got["causes"].items() if c["differ"]} == {cause}
    c = got["causes"][cause]
    assert c["differ"] == 20 and c["first_step"] == 0 and c["tokens_changed"] == 0
    assert abs(c["max_logprob_gap"] - 1e-3) < 1e-9
    assert under_load.CAUSES[cause][0] in under_load.report(got).splitlines()[-1]


def test_a_refused_request_counts_as_differing_and_says_why(monkeypatch):
    from minillama.oracle import under_load

    def fake(client, url, body):  # every request under load refused, the rest answered alike
        if body.get("stream") is False and fake.alone_done:
            return "HTTP 429: the server is busy"
        return [{"tokens": [1], "lps": [-1.0], "text": "a", "finish": "length"}]

    fake.alone_done = False
    send_alone = under_load._send_alone

    def alone_then_flag(*args, **kw):
        runs = send_alone(*args, **kw)
        fake.alone_done = True
        return runs

    monkeypatch.setattr(under_load, "_try", fake)
    monkeypatch.setattr(under_load, "_send_alone", alone_then_flag)
    monkeypatch.setattr(under_load, "probe_server", lambda client, url, model, prompts: under_load.Server(url, "m"))
    got = under_load.run("http://127.0.0.1:9/v1", requests=6, clients=2)
    batch = got["causes"]["batch"]
    assert batch["differ"] == batch["errors"] == 6 and not got["identical"]
    assert "6 got no answer, e.g. HTTP 429: the server is busy" in under_load.report(got)


def test_the_run_says_its_progress_at_a_terminal_only(monkeypatch, capsys):
    """`oracle load` with its default 200 probes ran for minutes with nothing said; at a terminal it now says
    each phase and every tenth of the probes sent alone (a log or a pipe gets the report alone)."""
    import io

    from minillama.oracle import under_load

    monkeypatch.setattr(under_load, "_try", lambda client, url, body: [answer([1], [-1.0])])
    monkeypatch.setattr(under_load, "probe_server", lambda client, url, model, prompts: under_load.Server(url, "m"))
    said: list[str] = []
    under_load.run("http://127.0.0.1:9/v1", requests=20, clients=2, say=said.append)
    assert said[0] == "20 probes, each sent alone four times (cold, alone, again, streamed)"
    assert said[1:-1] == [f"  {n} of 20 probes sent alone" for n in range(2, 21, 2)]
    assert said[-1].startswith("under load: the probes among ") and said[-1].endswith(" from 2 clients")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.setattr(under_load, "report", lambda r: "THE REPORT")
        assert main(["load", "--url", "http://127.0.0.1:9/v1", "--requests", "3"]) == 0
        assert ("minillama: 3 probes, each sent alone" in stream.getvalue()) == shown, stream.getvalue()
    assert capsys.readouterr().out.count("THE REPORT") == 2


def generate(ckpt, files, capsys, *flags) -> list[tuple[list[int], list[float]]]:
    capsys.readouterr()
    assert cli.main(["--model", str(ckpt), "--doc", str(files[0]), "--questions", str(files[1]), "-n", "4",
                     "--json", "--logprobs", "--no-chat-template", *flags]) == 0
    return [(r["token_ids"], r["logprobs"]) for r in map(json.loads, capsys.readouterr().out.splitlines())]


def test_generate_plain_kernels_answers_depend_on_the_batch(ckpt, tmp_path, capsys):
    """Parallel mode packs the questions into one pass: with the exact kernels each answer equals its
    independent run; with --plain-kernels (the honest baseline) some log-prob does not."""
    files = (tmp_path / "doc.txt", tmp_path / "q.txt")
    files[0].write_text(DOC)
    files[1].write_text("\n".join(QUESTIONS[:4]))
    assert generate(ckpt, files, capsys) == generate(ckpt, files, capsys, "--mode", "independent")
    assert generate(ckpt, files, capsys, "--plain-kernels") != \
        generate(ckpt, files, capsys, "--plain-kernels", "--mode", "independent")


def test_served_answers_on_a_kept_alive_connection_do_not_wait_for_delayed_acks(model):
    """minillama serve's socket names TCP, so asyncio turns Nagle's algorithm off: without that each answer
    on a kept-alive connection waited for the client's delayed ACK (about 40 ms)."""
    import httpx

    with serving(model) as url, httpx.Client(timeout=30) as client:
        times = []
        for _ in range(11):
            t0 = time.perf_counter()
            assert client.get(url + "/models").status_code == 200
            times.append(time.perf_counter() - t0)
    assert sorted(times)[5] < 0.02, times


@pytest.mark.parametrize("reply, stream", [
    ({"object": "text_completion"}, False),  # no choices
    ({"choices": ["x"]}, False),
    ({"choices": [{"text": "a", "logprobs": [1]}]}, False),
    ({"choices": [{"index": -1, "text": "a"}]}, False),  # another choice's place
    ("[" * 100000 + "]" * 100000, False),
    ({"choices": [{"text": "a", "logprobs": {"tokens": [1]}}]}, True),
    ({"choices": []}, False),  # no answer: once an empty one, alike every time (exit 0)
    ({"usage": {"completion_tokens": 1}}, True),
    ({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": ["-1.5"]}}]}, False),
    ({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": {"a": -1.5}}}]}, True),
    ({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [True]}}]}, False),
])
def test_a_malformed_answer_is_a_refusal_not_a_crash(reply, stream):
    """The load check reads another server's answers: one of another shape is named (`Refused`, reported as the
    request's failure), where it once raised KeyError, AttributeError or RecursionError, or was read as an empty
    answer (no choice), or held log-probs that crashed the comparison of two answers (a TypeError in `differ`)."""
    import httpx

    from minillama.serve.client import Refused, ask

    text = reply if isinstance(reply, str) else json.dumps(reply)
    body = f"data: {text}\n\ndata: [DONE]\n\n" if stream else text
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, text=body)))
    with pytest.raises(Refused, match="a malformed answer"):
        ask(client, "http://server/v1", "/completions", {"prompt": "x", "stream": stream})


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_sent_with_http_200_is_named(stream):
    import httpx

    from minillama.serve.client import Refused, ask

    text = json.dumps({"error": {"message": "model overloaded", "code": 503}})
    body = f"data: {text}\n\ndata: [DONE]\n\n" if stream else text
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, text=body)))
    with pytest.raises(Refused, match="an error in an answer of HTTP 200: .*model overloaded"):
        ask(client, "http://server/v1", "/completions", {"prompt": "x", "stream": stream})


@pytest.mark.parametrize("listed, shown", [(None, "null"), (7, "7"), ("", '""')])
def test_a_model_id_that_is_no_name_is_refused(listed, shown):
    """A null or a number as /models' first id was sent on as the model's name, in every probe request."""
    import httpx

    from minillama.oracle.backends import BackendError
    from minillama.oracle.under_load import probe_server

    models = {"data": [{"id": listed}]}
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=models)))
    with pytest.raises(BackendError, match=re.escape(f"http://server/v1/models: a malformed answer: data[0].id is "
                                                     f"{shown}, not a model's name; give the server's model name "
                                                     "with --model")):
        probe_server(client, "http://server/v1", None)


def test_a_server_that_does_not_answer_is_named_after_timeout(capsys):
    """Every request waited 600 s on a server that hangs (no option): its /models first, then each form of the
    probe request; --timeout names it after that long."""
    import socket

    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        t0 = time.monotonic()
        assert main(["load", "--url", url, "--timeout", "0.5"]) == 2
        assert capsys.readouterr().err == f"error: {url}/models: no answer within 0.5 s (--timeout)\n"
        assert main(["load", "--url", url, "--model", "m", "--timeout", "0.5"]) == 2
        err = capsys.readouterr().err
        assert err.endswith("every form of a one-token request was refused (no answer within 0.5 s (--timeout))\n")
        assert time.monotonic() - t0 < 10

"""No traceback for the machine's refusals or a tool's own options: every write meets a full disk
(RLIMIT_FSIZE makes it real), a full or closed stdout, a closed stdin, an unusable weights folder;
JSONL nested deep or holding lone surrogates; NaN weights; one runner giving every tool the same exit
statuses; the bench's options.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from minillama import checks, cli, errors, files  # noqa: E402
from minillama.weights import WeightsError  # noqa: E402
from test_api import DOC, QUESTIONS  # noqa: E402
from _faults import ROOT, ckpt, inputs, one_line_error, run_tool  # noqa: E402,F401  (fixtures)


# --- every write can meet a full disk; closed streams -------------------------------------------------


def test_every_file_write_goes_through_files_write_file():
    """Writes anywhere else would meet a full disk with an error type no front end catches."""
    allowed = {("minillama/weights/default.py", 'open(lock_path, "a")'),  # the lock file: flock, nothing written
               ("minillama/weights/default.py", 'open(part, "wb")'),  # inside a write_file callable
               ("minillama/bench/memory.py", 'open(_CLEAR, "w")'),  # /proc's control file: resets a counter
               ("minillama/errors.py", 'open(2, "w", closefd=False)')}  # stderr, already on /dev/null: no file
    pattern = re.compile(r"\.write_text\(|\.write_bytes\(|\.mkdir\(|open\([^)]*[\"'][wax]b?[\"']|\.savefig\(\w+ /"
                         r"|save_file\([^)]*str\((?!f\))")
    found = []
    for path in sorted((ROOT / "minillama").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "minillama/files.py":
            continue
        for line in path.read_text().splitlines():
            m = pattern.search(line)
            if m and not any(rel == f and s in line for f, s in allowed):
                found.append(f"{rel}: {line.strip()}")
    assert found == []


def test_write_file_is_atomic_and_one_line_on_a_full_disk(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("before")
    code = ("import sys; from minillama import files, errors; "
            f"sys.exit(errors.run_command(lambda: files.write_file({str(target)!r}, 'x' * 100000) and 0))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       preexec_fn=lambda: (signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
                                           resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))))
    assert "out.json: cannot write (File too large)" in one_line_error(p)
    assert target.read_text() == "before" and sorted(os.listdir(tmp_path)) == ["out.json"]


def test_write_file_leaves_modes_and_links_as_open_would(tmp_path):
    """A record from `oracle export` came out private (0600, as safetensors makes its files) beside its
    0644 JSON; a rewritten file lost its own mode; `bench --readme` on a symbolic link replaced the link
    with a file and left the link's target as it was."""
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        made = files.write_file(tmp_path / "r.safetensors", lambda f: save_file({"x": torch.zeros(2)}, str(f)))
        text = files.write_file(tmp_path / "r.json", "{}")
        own = tmp_path / "readme.md"
        own.write_text("before")
        own.chmod(0o640)
        (tmp_path / "link.md").symlink_to("readme.md")
        files.write_file(tmp_path / "link.md", "after")
        os.umask(0o077)
        private = files.write_file(tmp_path / "private.txt", "x")
    finally:
        os.umask(old)
    assert [made.stat().st_mode & 0o777, text.stat().st_mode & 0o777] == [0o644, 0o644]
    assert (tmp_path / "link.md").is_symlink() and own.read_text() == "after" and own.stat().st_mode & 0o777 == 0o640
    assert private.stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["link.md", "private.txt", "r.json", "r.safetensors", "readme.md"]


def test_a_conversion_is_readable_as_the_umask_says(ckpt, tmp_path):
    """Its folder is made private (mkdtemp) and safetensors writes private files: both opened up to the umask's."""
    from minillama import weights

    old = os.umask(0o022)
    try:
        out = weights.convert(ckpt, tmp_path / "hf")
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]} == \
        {out.name: 0o755, **{p.name: 0o644 for p in out.iterdir()}}
    assert "model.safetensors" in os.listdir(out)


def test_convert_on_a_full_disk_is_one_line(ckpt, tmp_path):
    p = run_tool("weights", "convert", ckpt, tmp_path / "out", limit_file_bytes=20_000)
    assert "cannot write the conversion (File too large)" in one_line_error(p)
    assert not (tmp_path / "out").exists()


def test_oracle_export_on_a_full_disk_is_one_line(ckpt, inputs, tmp_path):
    p = run_tool("oracle", "export", "--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"],
                 "-n", "2", "-o", tmp_path / "ref.safetensors", limit_file_bytes=2_000)
    # the manifest first (a failed run leaves the old record and manifest as they were): neither is left
    assert re.search(r"ref\.(json|safetensors): cannot write \(File too large\)", one_line_error(p))
    assert sorted(os.listdir(tmp_path)) == []


def test_bench_outputs_on_a_full_disk_are_one_line(tmp_path):
    p = run_tool("bench", "--from-json", ROOT / "docs/bench/results.json", "--out", tmp_path / "b",
                 limit_file_bytes=2_000)
    assert "cannot write (File too large)" in one_line_error(p)


def test_answers_to_a_full_stdout_are_one_line(ckpt, inputs):
    with open("/dev/full", "w") as full:
        p = run_tool("generate", "--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"],
                     "-n", "2", stdout=full, stderr=subprocess.PIPE)
    assert one_line_error(p) == (f"error: cannot write the output (No space left on device); 0 of {len(QUESTIONS)} "
                                 "answers written whole, and perhaps part of the next")  # a device: none taken back


@pytest.mark.parametrize("how", ["buffered", "unbuffered", "stderr in the file"])
def test_answers_to_a_full_disk_stay_whole_and_are_counted(ckpt, inputs, tmp_path, how):
    """A full disk in the third answer left half its JSON line in the file, and the line said nothing of how
    many answers were written; under `python -u` it said nothing at all until the fourth (Python's text layer
    dropped the rest of the third's short write). The third's part is taken back, and the line counts two."""
    args = ("--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"], "-n", "2", "--json")
    env = {"PYTHONUNBUFFERED": "1" if how == "unbuffered" else ""}
    lines = run_tool("generate", *args, env=env).stdout.splitlines(keepends=True)
    assert len(lines) == len(QUESTIONS)
    said = f"error: cannot write the output (File too large); 2 of {len(QUESTIONS)} answers written"
    with open(tmp_path / "out.jsonl", "w") as out:
        p = run_tool("generate", *args, env=env, stdout=out, stderr=out if how == "stderr in the file" else
                     subprocess.PIPE, limit_file_bytes=len("".join(lines[:2]).encode()) + len(lines[2]) // 2)
    written = (tmp_path / "out.jsonl").read_text()
    if how == "stderr in the file":  # the line follows the answers, where the third's part was
        assert p.returncode == 2 and written == "".join(lines[:2]) + said + "\n", written
    else:
        assert one_line_error(p) == said and written == "".join(lines[:2])


@pytest.mark.parametrize("tool", [["generate", "--doc", "-", "--questions", "Q"], ["weights", "info", "."],
                                  ["oracle", "compare", "--candidate", "x.jsonl", "--reference", "y"],
                                  ["bench", "--from-json", "x.json"], ["--help"]])  # the last: it exited 0
def test_a_closed_stdout_is_one_line(tool, tmp_path):
    p = run_tool(*tool, preexec=lambda: os.close(1), stderr=subprocess.PIPE)
    assert one_line_error(p) == "error: standard output is closed; the output would be lost"


@pytest.mark.parametrize("tool", [["--help"], ["generate", "--help"], ["weights", "info", "--help"],
                                  ["oracle", "--help"], ["bench", "--help"], ["serve", "--help"]])
def test_help_to_a_full_stdout_is_one_line(tool):
    """`generate --help > /dev/full` said nothing and exited 0 (argparse swallows the OSError of its write, in
    every tool's parser), and `minillama --help > /dev/full` was a traceback, exit 1."""
    with open("/dev/full", "w") as full:
        p = run_tool(*tool, stdout=full, stderr=subprocess.PIPE)
    assert one_line_error(p) == "error: cannot write the output (No space left on device)"


@pytest.mark.parametrize("tool", [["generate"], ["weights", "fetch"], ["oracle", "compare"], ["bench"], ["serve"]])
def test_a_tools_usage_names_it_as_the_user_typed_it(tool):
    """`minillama weights fetch --help` said "usage: python -m minillama.weights fetch", and `python -m
    minillama.serve --help` said "usage: minillama serve": each tool named itself one way, however run."""
    module = "minillama." + tool[0]
    for argv, name in ((["-m", "minillama", *tool], f"minillama {' '.join(tool)}"),
                       (["-m", module, *tool[1:]], f"python -m {module} {' '.join(tool[1:])}".rstrip())):
        p = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert p.returncode == 0 and p.stdout.startswith(f"usage: {name} ["), (argv, p.stdout[:80], p.stderr)


def _read_only_stderr() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 2)


@pytest.mark.parametrize("stderr", ["closed", "read-only"])
def test_an_unusable_stderr_leaves_the_output_and_the_status_as_they_are(ckpt, inputs, stderr):
    """Started with stderr closed (`2>&-`: Python's sys.stderr is None, and a print to it writes to stdout) or
    open for reading only (a shell wrapper's own script): the answers alone on stdout, status 0; a bad input
    is status 2 with nothing on stdout; the --json summary and every message go nowhere."""
    preexec = (lambda: os.close(2)) if stderr == "closed" else _read_only_stderr
    ok = run_tool("generate", "--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"], "-n", "2",
                  "--json", preexec=preexec, stdout=subprocess.PIPE)
    answers = [json.loads(line) for line in ok.stdout.splitlines()]
    assert ok.returncode == 0 and answers and all("question" in a for a in answers), ok.stdout
    bad = run_tool("generate", "--model", ckpt, "--doc", "/nonexistent/doc.txt", "--questions", inputs["questions"],
                   preexec=preexec, stdout=subprocess.PIPE)
    assert (bad.returncode, bad.stdout) == (2, "")


def test_a_local_rank_that_is_no_gpu_index_is_one_line(ckpt, inputs):
    p = run_tool("generate", "--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"],
                 "--device", "cuda", env={"LOCAL_RANK": "xyz"})
    assert one_line_error(p).startswith("error: LOCAL_RANK='xyz' in the environment: the index of this rank's GPU")


def test_a_closed_stdin_is_one_line(ckpt, inputs):
    p = run_tool("generate", "--model", ckpt, "--doc", "-", "--questions", inputs["questions"],
                 preexec=lambda: os.close(0))
    assert one_line_error(p) == "error: --doc -: standard input is closed"


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_fetch_into_an_unusable_weights_folder_is_one_line(tmp_path, where):
    f = tmp_path / "f"
    f.write_text("x")
    wdir = f if where == "a file" else f / "sub"
    p = run_tool("weights", "fetch", env={"MINILLAMA_WEIGHTS_DIR": str(wdir)})
    assert "MINILLAMA_WEIGHTS_DIR" in one_line_error(p) and str(wdir) in p.stderr


# --- malformed input files ------------------------------------------------------------------------------


@pytest.mark.parametrize("line,word", [("[" * 100_000, "nested too deeply"),
                                       ('{"doc": "a \\ud800 b", "questions": ["q"]}', '"doc": a lone surrogate U+D800'),
                                       ('{"doc": "d", "questions": ["q", "\\udfff"]}',
                                        "question 2: a lone surrogate U+DFFF")])  # which one (it was not said)
def test_jsonl_lines_that_are_not_text_are_one_line(ckpt, inputs, capsys, line, word):
    f = inputs["dir"] / "bad.jsonl"
    f.write_text(json.dumps({"doc": DOC, "questions": ["q"]}) + "\n" + line + "\n")
    code = cli.main(["--model", str(ckpt), "--input", str(f)])
    err = one_line_error((code, capsys.readouterr().err))
    assert "line 2" in err and word in err


def test_nan_weights_write_valid_json_and_warn(ckpt, inputs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"][:] = float("nan")
    save_file(sd, str(d / "model.safetensors"))
    p = run_tool("generate", "--model", d, "--doc", inputs["doc"], "--questions", inputs["questions"], "-n", "2",
                 "--json", "--logprobs")
    assert p.returncode == 0, p.stderr

    def strict(x):
        raise ValueError(f"not JSON: {x}")

    rows = [json.loads(line, parse_constant=strict) for line in p.stdout.splitlines()]
    assert len(rows) == len(QUESTIONS) and all(x is None for r in rows for x in r["logprobs"])
    assert sum("warning:" in line and "not finite" in line for line in p.stderr.splitlines()) == 1
    p = run_tool("generate", "--model", d, "--doc", inputs["doc"], "--questions", inputs["questions"], "-n", "2",
                 "--temperature", "0.7")
    assert "logits hold NaN or +inf" in one_line_error(p)


def test_float16_activations_past_its_range_are_named_as_the_cause(ckpt, inputs, tmp_path):
    """Finite weights (float32 answers with finite log-probs) whose activations pass 65504 in float16: the
    warning and the sampler's error name float16's range and the dtypes that hold it, not broken weights."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "big"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    for name, scale in (("up_proj", 300.0), ("down_proj", 300.0)):
        sd[f"model.layers.0.mlp.{name}.weight"] *= scale
    assert all(v.abs().max() < 65504 for v in sd.values())  # every weight fits float16
    save_file(sd, str(d / "model.safetensors"))
    run = ("generate", "--model", d, "--doc", inputs["doc"], "--questions", inputs["questions"], "-n", "2", "--json",
           "--logprobs")
    p = run_tool(*run)
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr
    assert all(x is not None for line in p.stdout.splitlines() for x in json.loads(line)["logprobs"])
    cause = "the activations passed float16's largest value, 65504 (bfloat16 and float32 hold them)"
    p = run_tool(*run, "--dtype", "float16")
    assert p.returncode == 0, p.stderr
    assert sum("warning:" in line and "not finite" in line and cause in line for line in p.stderr.splitlines()) == 1
    p = run_tool(*run, "--dtype", "float16", "--temperature", "0.7")
    assert "logits hold NaN or +inf" in one_line_error(p) and cause in one_line_error(p)


# --- one runner for every tool: the exit statuses --------------------------------------------------------


def _tool_bodies(monkeypatch):
    """Each tool's main() with its body replaced by `raise_it`."""
    import minillama.bench.command as bench
    import minillama.oracle.__main__ as oracle
    import minillama.weights.cli as weights

    def patch(raise_it):
        monkeypatch.setattr(cli, "_main", lambda argv: raise_it())
        monkeypatch.setattr(weights, "_main", lambda argv: raise_it())
        monkeypatch.setattr(oracle, "build_parser", raise_it)
        monkeypatch.setattr(bench, "_main", lambda argv: raise_it())
        return {"generate": cli.main, "weights": weights.main, "oracle": oracle.main, "bench": bench.main}

    return patch


def _raiser(e: BaseException):
    def raise_it(*a, **k):
        raise e
    return raise_it


OUT_OF_MEMORY = "free memory, or ask for less (a smaller model, shorter input, fewer questions at once)"


@pytest.mark.parametrize("exc,code,stderr", [
    (errors.BadInput("bad value"), 2, "error: bad value\n"),
    (WeightsError("x.gguf: corrupt\nfile"), 2, "error: x.gguf: corrupt file\n"),
    (errors.CannotWrite("out", "No space left on device"), 2,
     "error: out: cannot write (No space left on device)\n"),
    (PermissionError(13, "Permission denied", "/ro/file"), 2, "error: /ro/file: Permission denied\n"),
    (KeyboardInterrupt(), 130, "interrupted\n"),
    (BrokenPipeError(), 141, ""),
    (MemoryError(), 2, f"error: out of memory (MemoryError); {OUT_OF_MEMORY}\n"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)"), 2,
     "error: out of memory ([enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
     f"you tried to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)); {OUT_OF_MEMORY}\n"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), 2,
     f"error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); {OUT_OF_MEMORY}\n"),
])
def test_every_tool_maps_errors_to_the_same_exit_status(monkeypatch, capsys, exc, code, stderr):
    for name, main in _tool_bodies(monkeypatch)(_raiser(exc)).items():
        assert main([]) == code, name
        assert capsys.readouterr().err == stderr, name


def test_a_bug_is_a_traceback_in_every_tool(monkeypatch):
    for name, main in _tool_bodies(monkeypatch)(_raiser(ValueError("a bug in minillama"))).items():
        with pytest.raises(ValueError, match="a bug"):
            main([])


def test_an_option_of_one_value_given_twice_is_refused_in_every_tool(capsys):
    """argparse keeps the last: `--questions a.txt --questions b.txt` answered b's questions alone, without a
    word. Refused, naming the option's names and both values; an option that gathers (--stop) still does."""
    import minillama.bench.command as bench
    import minillama.oracle.__main__ as oracle
    import minillama.serve.cli as serve

    for main, argv, said in (
            (cli.main, ["--doc", "d", "--questions", "a.txt", "--questions", "b.txt"],
             "error: --questions given twice ('a.txt', then 'b.txt'): give it once"),
            (cli.main, ["-n", "1", "--max-new-tokens", "2"], "error: --max-new-tokens/-n given twice (1, then 2)"),
            (serve.main, ["--port", "1", "--port", "2"], "error: --port given twice"),
            (bench.main, ["--repeats", "1", "--repeats", "2"], "error: --repeats given twice"),
            (oracle.main, ["compare", "--backend", "openai", "--backend", "transformers"],
             "error: --backend given twice")):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith(said), argv
    assert cli.build_parser().parse_args(["--stop", "a", "--stop", "b"]).stop == ["a", "b"]


def test_a_tool_without_its_command_names_the_commands(capsys):
    """It said "the following arguments are required: cmd", the parser's own name for the command."""
    import minillama.oracle.__main__ as oracle
    import minillama.weights.cli as weights

    for main, commands in ((weights.main, "fetch,convert,info"), (oracle.main, "export,compare,load")):
        assert main([]) == 2
        assert capsys.readouterr().err == f"error: the following arguments are required: {{{commands}}}\n"
        for command in commands.split(","):  # each one named is a command of the tool
            with pytest.raises(SystemExit) as done:
                main([command, "--help"])
            assert done.value.code == 0 and capsys.readouterr().out.startswith("usage:")


# --- the bench's own options -------------------------------------------------------------------------


def test_bench_options_are_one_line(tmp_path, capsys):
    from minillama.bench.command import main

    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "other.json").write_text('{"a": 1}')
    (tmp_path / "file").write_text("x")
    out = ["--out", str(tmp_path / "o")]
    cases = {
        "--from-json " + str(tmp_path / "missing.json"): "no such file",
        "--from-json " + str(tmp_path / "bad.json"): "not JSON",
        "--from-json " + str(tmp_path / "deep.json"): "not JSON",
        "--from-json " + str(tmp_path / "other.json"): "not a bench results.json",
        "--quick --only headlines": "--only: unknown sweep(s) headlines",
        "--quick --only ,": "--only: no sweep named",
        "--quick --threads -2": "--threads must be at least 1",
        "--quick --repeats 0": "--repeats must be at least 1",
        "--quick --sample -1": "--sample must be at least 0",
        "--quick --threads two": "--threads",
        "--quick --methods telepathy": "unknown method(s) telepathy",
    }
    for args, word in cases.items():
        line = one_line_error((main(args.split() + out), capsys.readouterr().err))
        assert word in line, (args, line)
    line = one_line_error((main(["--quick", "--out", str(tmp_path / "file" / "o")]), capsys.readouterr().err))
    assert "cannot make the folder" in line
    line = one_line_error((main(["--quick", "--out", str(tmp_path / "file")]), capsys.readouterr().err))
    assert "exists and is not a folder" in line


def test_json_text_is_valid_json_for_non_finite_numbers():
    text = files.json_text({"a": [1.0, float("nan"), float("inf")], "b": {"c": -float("inf")}})
    assert json.loads(text) == {"a": [1.0, None, None], "b": {"c": None}}
    assert files.json_text({"a": 0.1}) == json.dumps({"a": 0.1})


def test_check_options_spells_names_the_callers_way():
    with pytest.raises(errors.BadInput, match="^--max-new-tokens must be >= 0, got -1$"):
        checks.check_options(max_new_tokens=-1, spell=lambda n: "--" + n.replace("_", "-"))


# --- input size: bounded where it is read (inputs.read_text), counted as the tokenizer keeps it -------------


class EndlessStream:
    """A stream that never ends (as /dev/zero or `yes` do), counting the bytes it hands out; past `most` it
    raises, so that a reader that does not stop fails the test instead of taking the machine's memory."""

    def __init__(self, chunk: bytes, most: int):
        self.chunk, self.most, self.given = chunk, most, 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or self.given > self.most:
            raise AssertionError(f"read past {self.most:,} bytes (asked for {n})")
        self.given += n
        return (self.chunk * (n // len(self.chunk) + 1))[:n]


@pytest.mark.parametrize("chunk,word", [(b"y\n", "longer than"), (b"\0", "binary"),
                                        (bytes(range(256)), "binary"), (b"\xff\xfe", "not UTF-8")])
def test_an_endless_input_is_read_up_to_the_limit_or_its_first_bad_block(ckpt, inputs, capsys, monkeypatch,
                                                                          chunk, word):
    """`yes`, /dev/zero, /dev/urandom on standard input: refused at the limit (for the tiny model's 512-token
    context, under 2 MiB: what the context could hold, plus a margin) or at the first 64 KiB block holding a
    NUL or a byte that is not UTF-8, never read to the end."""
    stream = EndlessStream(chunk, 2 << 20)
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": stream})())
    code = cli.main(["--model", str(ckpt), "--doc", "-", "--questions", str(inputs["questions"])])
    assert word in one_line_error((code, capsys.readouterr().err))
    assert stream.given <= (2 << 20 if word == "longer than" else 1 << 16)


def _memory_bound():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the old reader met MemoryError here


@pytest.mark.parametrize("source", ["/dev/zero", "/dev/urandom", "yes"])
def test_an_endless_document_is_one_line_from_the_cli(ckpt, inputs, source):
    """The command line on /dev/zero, /dev/urandom and `yes | ... --doc -`, under a 3 GiB address-space
    bound: one line, exit 2, in seconds (the whole file was read before, until memory ran out)."""
    if source == "yes":
        yes = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
        try:
            p = run_tool("generate", "--model", ckpt, "--doc", "-", "--questions", inputs["questions"],
                         stdin=yes.stdout, preexec=_memory_bound)
        finally:
            yes.kill()
            yes.wait()
    else:
        p = run_tool("generate", "--model", ckpt, "--doc", source, "--questions", inputs["questions"],
                     preexec=_memory_bound)
    line = one_line_error(p)
    assert ("longer than" in line and "context is 512" in line) if source == "yes" else "binary" in line, line


def test_ten_megabytes_of_zero_width_spaces_are_refused_without_tokenizing_them():
    """A byte-level BPE keeps every zero-width space (three bytes each): the length check counts them as the
    tokenizer does, so 10 MB of them are refused in one pass over the text, not after tokenizing it."""
    from test_api import tiny_loaded
    from test_faults import CountingTokenizer

    small = tiny_loaded(max_pos=512)
    counting = CountingTokenizer(small.tokenizer)
    checks.too_long(counting, [("x", ["q"])], 512)  # the tokenizer's one probe of which characters it keeps
    counting.chars = 0
    from minillama import api

    with pytest.raises(api.PromptTooLong, match="at least .* tokens"):
        api.ask(api.LoadedModel(small.llama, counting), "\u200b" * 10_000_000, QUESTIONS[:1], max_new_tokens=2)
    assert counting.chars == 0


def test_zero_width_spaces_in_a_file_are_refused_from_their_length(ckpt, inputs, capsys):
    """The command line: a document of zero-width spaces under the read limit but past the context is
    refused from the characters the tokenizer keeps ("at least N tokens"), before any prompt is tokenized."""
    f = inputs["dir"] / "zwsp.txt"
    f.write_text("\u200b" * 300_000)
    code = cli.main(["--model", str(ckpt), "--doc", str(f), "--questions", str(inputs["questions"])])
    assert re.search(r"the prompt has at least \d+ tokens", one_line_error((code, capsys.readouterr().err)))


HELD = """
import os, signal, sys, tempfile, time
import minillama
from minillama import errors, interrupts
interrupts.hold_interrupts()  # as the package does while `python -m minillama.X` imports it
d = tempfile.mkdtemp()
with open(os.path.join(d, "slow_import.py"), "w") as f:  # a module whose import is Ctrl-C'd, as torch's may be
    f.write("import os, signal, time\\nos.kill(os.getpid(), signal.SIGINT)\\ntime.sleep(0.2)\\nDONE = True\\n")
sys.path.insert(0, d)
import slow_import
print("imported", slow_import.DONE, flush=True)
sys.exit(errors.run_command(lambda: print("the body ran") or 0))
"""


def test_a_ctrl_c_during_a_commands_imports_is_said_as_interrupted():
    """A Ctrl-C while `python -m minillama.X` imports (torch's import takes seconds) was a traceback, or,
    where a library's import swallowed it, a half-imported numpy failing later as a bug (exit 1): it is held
    until the command's runner, which says "interrupted" (130) before the body runs."""
    p = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (130, "imported True\n", "interrupted\n"), p.stderr
    # outside an import it is raised at once, and one the process was started ignoring stays ignored
    outside = HELD.split("d = tempfile")[0] + "os.kill(os.getpid(), signal.SIGINT); time.sleep(5); print('slept')"
    p = subprocess.run([sys.executable, "-c", outside], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr and "slept" not in p.stdout
    p = subprocess.run([sys.executable, "-c", outside], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (p.returncode, p.stdout) == (0, "slept\n"), p.stderr


LATE = """
import signal, sys, time, types
from minillama import interrupts
interrupts.hold_interrupts()
interrupts.release_interrupts()  # the command runs
code = types.SimpleNamespace(co_filename="<frozen importlib._bootstrap>")  # importlib's module-lock callback
try:
    signal.getsignal(signal.SIGINT)(signal.SIGINT, types.SimpleNamespace(f_code=code, f_back=None))
except KeyboardInterrupt:
    sys.exit("raised inside the import, where Python ignores it")
try:
    time.sleep(10)
except KeyboardInterrupt:
    sys.exit("interrupted")
print("never raised")
"""


def test_a_ctrl_c_during_an_import_once_the_command_runs_is_raised_after_it():
    """Once the command ran, a Ctrl-C was raised wherever it landed: inside importlib's module-lock callback
    (a lazy import while loading) Python printed 'Exception ignored' and the run went on to exit 0. It is sent
    again a moment later, outside the import."""
    p = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "interrupted\n"), (p.stdout, p.stderr)


def test_a_program_importing_minillama_keeps_its_ctrl_c():
    """Only `python -m minillama...` holds Ctrl-C while it starts; a program that imports the package keeps
    Python's handler."""
    p = subprocess.run([sys.executable, "-c", "import signal, minillama; "
                        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.stdout == "True\n", p.stderr


@pytest.mark.parametrize("delay", [0.3, 1.0])
def test_ctrl_c_while_the_command_starts(ckpt, inputs, delay):
    """The real command, interrupted while it imports or loads: one line and 130, never a traceback."""
    p = subprocess.Popen([sys.executable, "-m", "minillama.generate", "--model", str(ckpt), "--doc",
                          str(inputs["doc"]), "--questions", str(inputs["questions"]), "-n", "200"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err and err.startswith("interrupted"), (p.returncode, err)


def test_a_ctrl_c_between_an_answers_write_and_its_count_waits_for_both():
    """The count said "0 of N answers written" after one: Ctrl-C came between the answer's write and its count.
    Held until both are done; a second Ctrl-C is raised at once (a write blocked on a reader that does not read)."""
    code = ("import os, signal\nfrom minillama import interrupts\nwritten = 0\ntry:\n"
            "    with interrupts.together():\n        os.kill(os.getpid(), signal.SIGINT)\n        written += 1\n"
            "except KeyboardInterrupt:\n    print('interrupted after', written)\n"
            "try:\n    with interrupts.together():\n        os.kill(os.getpid(), signal.SIGINT)\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n        written += 1\n"
            "except KeyboardInterrupt:\n    print('twice: interrupted at', written)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.stdout == "interrupted after 1\ntwice: interrupted at 1\n", p.stderr

"""minillama as an installable package: the wheel holds every module and declares its dependencies; installed
into a fresh environment (marked slow), the `minillama` command, the generator and the oracle run from outside
the checkout, and the default model would go to the user's cache directory, never beside site-packages.

The wheel is built from a copy of the sources (pyproject.toml, README.md, minillama/) so that the checkout gets
no build/ or egg-info litter. pip installs it with --no-deps into a venv that sees this interpreter's packages:
nothing is downloaded, and never an unpinned torch.
"""

from __future__ import annotations

import ast
import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minillama.weights import save_hf_dir
from test_api import DOC, QUESTIONS, tiny_tokenizer
from tiny import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "minillama", src / "minillama", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                        "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (whl,) = out.glob("minillama-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], email.message.Message, str]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        return names, email.message_from_bytes(z.read(meta)), z.read(entry).decode()


def test_wheel_holds_every_module(wheel):
    names, _, _ = _metadata(wheel)
    source = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "minillama").rglob("*.py")
                    if "__pycache__" not in p.parts)
    assert [s for s in source if s not in names] == []
    # the subpackages by name, so that a future flat layout cannot pass by accident
    assert {"minillama/oracle/__init__.py", "minillama/bench/__init__.py", "minillama/__main__.py"} <= set(names)


def test_wheel_declares_dependencies_and_the_command(wheel):
    _, meta, entry = _metadata(wheel)
    requires = meta.get_all("Requires-Dist") or []
    runtime = {re.split(r"[<>=;\[ ]", r)[0].lower() for r in requires if "extra ==" not in r}
    assert {"torch", "numpy", "safetensors", "sentencepiece", "tokenizers", "gguf", "jinja2"} <= runtime
    # torch pinned exactly as requirements.txt pins it: bit-parity is promised per torch version
    pin = next(line for line in (ROOT / "requirements.txt").read_text().split() if line.startswith("torch"))
    assert pin in [r.replace(" ", "") for r in requires]
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"test", "hf", "plots"} <= extras
    assert any(r.startswith("transformers") and 'extra == "hf"' in r for r in requires)
    assert re.search(r"^minillama\s*=\s*minillama\.__main__:main$", entry, re.M), entry


DISTRIBUTIONS = {"llama_cpp": "llama-cpp-python", "jinja2": "jinja2"}  # an import's name -> its distribution's


def _third_party_imports(where: Path) -> dict[str, str]:
    """Each distribution the modules under `where` import (at the top or inside a function), with one module
    that imports it."""
    found: dict[str, str] = {}
    for f in sorted(where.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"minillama"}:
                found.setdefault(DISTRIBUTIONS.get(top, top), f.relative_to(ROOT).as_posix())
    return found


def test_each_extra_declares_what_its_part_imports(wheel):
    """`pip install '.[serve]'` gives the server, its bench and its load generator all they import (the peer
    they are measured against aside: llama.cpp, its own extra); every import of minillama is declared
    somewhere, as runtime or an extra."""
    requires = _metadata(wheel)[1].get_all("Requires-Dist") or []
    declared: dict[str | None, set[str]] = {}
    for r in requires:
        extra = re.search(r'extra == "([^"]+)"', r)
        declared.setdefault(extra and extra.group(1), set()).add(re.split(r"[<>=;\[ ]", r)[0].lower())
    everything = set().union(*declared.values())
    assert {d: f for d, f in _third_party_imports(ROOT / "minillama").items() if d not in everything} == {}
    serve = declared[None] | declared["serve"] | declared["llamacpp"]
    assert {d: f for d, f in _third_party_imports(ROOT / "minillama" / "serve").items() if d not in serve} == {}


@pytest.mark.slow
def test_installed_command_runs_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=300)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MINILLAMA_WEIGHTS_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")

    def run(*args: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=work, env=env, timeout=900)

    where = run(py, "-c", "import minillama, minillama.weights as w; print(minillama.__file__); print(w.weights_dir())")
    assert where.returncode == 0, where.stderr
    module, weights = where.stdout.split("\n")[:2]
    assert Path(module).is_relative_to(venv) and not Path(module).is_relative_to(ROOT)
    assert Path(weights) == tmp_path / "cache" / "minillama"  # the user's cache, not beside site-packages

    p = run(bindir / "minillama", "--help")
    assert p.returncode == 0 and all(c in p.stdout for c in ("generate", "weights", "oracle", "bench")), p.stderr
    p = run(bindir / "minillama", "nonsense")
    assert p.returncode == 2 and "unknown command" in p.stderr and "Traceback" not in p.stderr

    tok = tiny_tokenizer()
    config = tiny_config(vocab=tok.vocab_size, max_pos=512, tied=True)
    ckpt = save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, tmp_path / "tiny")
    (work / "doc.txt").write_text(DOC)
    (work / "q.txt").write_text("\n".join(QUESTIONS[:2]))
    p = run(bindir / "minillama", "generate", "-m", ckpt, "--doc", "doc.txt", "--questions", "q.txt", "-n", "3",
            "--json")
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == 2
    p = run(bindir / "minillama", "weights", "info", ckpt)
    assert p.returncode == 0 and "hf checkpoint" in p.stdout and "layers 2" in p.stdout, p.stderr
    p = run(bindir / "minillama", "oracle", "compare", "--backend", "transformers", "-m", ckpt, "--doc", "doc.txt",
            "--questions", "q.txt", "-n", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 of 2 questions pass: PASS" in p.stdout


def test_weights_dir_follows_the_environment_then_the_checkout(monkeypatch, tmp_path):
    from minillama.weights import weights_dir

    monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", str(tmp_path / "mine"))
    assert weights_dir() == tmp_path / "mine"
    monkeypatch.delenv("MINILLAMA_WEIGHTS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert weights_dir() == ROOT / "weights"  # a source checkout keeps its weights/ (installed: see above)

"""The option table (`minillama/options.py`): one row per option of `api.ask_many`, from which the command
line's flags, the API's checks and the refusals' messages all come.

A flag and its API keyword refuse the same bad value with the same message (spelled `--top-k` or `top_k`);
every SamplingParams field has a row, and every row a flag or the reason it has none; the parser's
defaults are the API's. Each check is shown able to fail: on a doctored table, and with the command
line's own conversion of a flag's text (`options.parse_or_keep`) switched off.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from minillama import api, checks, cli, options
from minillama.generate import SamplingParams
from minillama.weights import save_hf_dir
from test_api import tiny_tokenizer
from tiny import tiny_config, tiny_model

# One bad value per option the command line can give a value to: (the flag's text, the API's value).
BAD = {"mode": ("turbo", "turbo"), "max_new_tokens": ("-1", -1), "temperature": ("nan", float("nan")),
       "top_k": ("-2", -2), "top_p": ("1.5", 1.5), "seed": ("x", "x"), "stop": ("", ""),
       "parallel_size": ("0", 0), "batch_docs": ("-3", -3), "system": ("be \ud800brief", "be \ud800brief")}
# Bad text that the flag's type cannot even parse: the API's value is that text.
UNPARSED = {"max_new_tokens": "ten", "temperature": "warm", "top_k": "2.5", "top_p": "half", "seed": "1e3",
            "parallel_size": "all", "batch_docs": "some"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[api.LoadedModel, list[str]]:
    """The tiny model, and the command line's arguments that name it and a document and questions."""
    tok = tiny_tokenizer()
    d = tmp_path_factory.mktemp("opts")
    config = tiny_config(vocab=tok.vocab_size, max_pos=256, tied=True)
    path = save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, d / "tiny")
    (d / "doc.txt").write_text("The bridge opened in 1932.\n")
    (d / "q.txt").write_text("When did it open?\n")
    return api.load(path), ["--model", str(path), "--doc", str(d / "doc.txt"), "--questions", str(d / "q.txt")]


def api_message(model: api.LoadedModel, name: str, value) -> str:
    with pytest.raises(ValueError) as e:  # BadInput and BadType are both ValueErrors
        api.ask(model, "The bridge opened in 1932.", ["When?"], **{name: value})
    return str(e.value)


def cli_message(argv: list[str], capsys) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):].rstrip("\n")


def spelled(name: str, message: str) -> str:
    """The API's message as the command line spells it: the keyword's name made its flag."""
    assert message.startswith(name), message
    return checks.flag(name) + message[len(name):]


def valued_flags() -> set[str]:
    return {name for name, row in checks.OPTIONS.items() if row.flag and row.action not in ("store_true", "store_false")}


def test_every_flag_with_a_value_has_a_bad_example():
    assert set(BAD) == valued_flags()
    assert set(UNPARSED) == {n for n in valued_flags() if checks.OPTIONS[n].parse is not None}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_flag_and_its_keyword_refuse_a_bad_value_alike(setup, capsys, name):
    model, argv = setup
    text, value = BAD[name]
    assert cli_message([*argv, checks.flag(name), text], capsys) == spelled(name, api_message(model, name, value))


@pytest.mark.parametrize("name", sorted(UNPARSED))
def test_text_a_flag_cannot_parse_is_refused_as_the_api_refuses_it(setup, capsys, name):
    model, argv = setup
    text = UNPARSED[name]
    assert cli_message([*argv, checks.flag(name), text], capsys) == spelled(name, api_message(model, name, text))


@pytest.mark.parametrize("name, mode", [("parallel_size", "independent"), ("batch_docs", "seqbatch")])
def test_a_size_of_parallel_mode_in_another_mode_is_refused_alike(setup, capsys, name, mode):
    """Read by nothing outside parallel mode, these were ignored without a word (so was --max-memory)."""
    model, argv = setup
    with pytest.raises(ValueError) as e:
        api.ask(model, "The bridge opened in 1932.", ["When?"], mode=mode, **{name: 2})
    line = cli_message([*argv, "--mode", mode, checks.flag(name), "2"], capsys)
    assert line == f"{checks.flag(name)} sizes parallel mode's passes; --mode {mode} answers one question at a " \
                   f"time: drop {checks.flag(name)}"
    assert str(e.value) == line.replace(checks.flag(name), name).replace("--mode", "mode")
    assert cli_message([*argv, "--mode", mode, "--max-memory", "64"], capsys).startswith(
        f"--max-memory sizes parallel mode's waves; --mode {mode} holds one question at a time")


def test_negative_control_argparse_own_conversion_words_it_otherwise(setup, capsys, monkeypatch):
    # With the flag's text converted by argparse itself (the table's conversion switched off), the command
    # line's refusal is argparse's and no longer the API's: the comparison above can fail.
    model, argv = setup
    monkeypatch.setattr(cli, "parse_or_keep", lambda parse: parse)
    line = cli_message([*argv, "--seed", "x"], capsys)
    assert line != spelled("seed", api_message(model, "seed", "x"))
    assert "invalid int value" in line


def unflagged(rows: dict[str, options.Option], help_text: str) -> list[str]:
    """Rows with no flag in the parser's help and no stated reason for having none."""
    return [name for name, row in rows.items()
            if not (row.flag and f"{row.flag} " in help_text or row.flag is None and row.no_flag)]


def test_every_sampling_field_has_a_row_and_a_flag_or_a_reason():
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert list(checks.SAMPLING_OPTIONS) == fields
    assert all(isinstance(f.metadata.get("option"), options.Option) for f in dataclasses.fields(SamplingParams))
    help_text = cli.build_parser().format_help()
    assert unflagged(checks.OPTIONS, help_text) == []
    # the negative control: a row whose flag the parser lacks, and a row with neither flag nor reason
    doctored = {**checks.OPTIONS, "x": options.Option("x", (), "--not-offered"), "y": options.Option("y", ())}
    assert unflagged(doctored, help_text) == ["x", "y"]


def test_every_flag_sets_its_field_and_the_defaults_are_the_apis():
    parser = cli.build_parser()
    args = parser.parse_args([])
    assert cli.sampling(args) == SamplingParams()  # the parser's defaults are the API's
    signature = inspect.signature(api.ask_many).parameters
    for name, row in checks.RUN_OPTIONS.items():
        assert signature[name].default == row.default, name
        if row.flag:
            assert getattr(args, name) == row.default, name
    given = parser.parse_args(["-n", "5", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9", "--seed", "7",
                               "--ignore-eos", "--stop", "a", "--stop", "b"])
    assert cli.sampling(given) == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=7,
                                                 ignore_eos=True, stop=["a", "b"])
    assert cli.sampling(given) != SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=7,
                                                 ignore_eos=True, stop=["a"])


def test_sampling_params_refuse_what_the_api_refuses():
    for name, (_, value) in BAD.items():
        if name in checks.SAMPLING_OPTIONS:
            with pytest.raises(ValueError, match=f"^{name}"):
                SamplingParams(**{name: value})
    with pytest.raises(TypeError, match="keep_logits must be True or False"):
        SamplingParams(keep_logits=1)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


def test_params_and_keywords_are_one_carrier(setup):
    model, _ = setup
    params = SamplingParams(max_new_tokens=4, temperature=0.8, seed=3, ignore_eos=True)
    by_params = api.ask(model, "The bridge opened in 1932.", ["When?", "Where?"], params)
    by_keywords = api.ask(model, "The bridge opened in 1932.", ["When?", "Where?"], max_new_tokens=4,
                          temperature=0.8, seed=3, ignore_eos=True)
    assert by_params == by_keywords
    other_seed = api.ask(model, "The bridge opened in 1932.", ["When?", "Where?"], params, seed=4)  # replaces
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in by_params]
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        api.ask(model, "The bridge opened in 1932.", ["When?"], temprature=0.5)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        api.ask(model, "The bridge opened in 1932.", ["When?"], {"seed": 1})


def test_the_command_line_entries_reach_the_one_dispatcher(setup, capsys):
    # `python -m minillama.generate` and `minillama generate` are the same command, through one runner
    from minillama.__main__ import COMMANDS, main as dispatch

    _, argv = setup
    assert COMMANDS["generate"][0] == "minillama.cli"
    assert dispatch(["generate", *argv, "--top-k", "-2"]) == 2
    assert capsys.readouterr().err == "error: --top-k must be >= 0 (0: off) and below 2**31, got -2\n"
    source = Path(cli.__file__).with_name("generate.py").read_text()
    assert "from .cli" not in source and "import cli" not in source  # generate does not import its CLI

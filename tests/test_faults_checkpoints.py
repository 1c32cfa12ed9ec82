"""A bad checkpoint is one line naming the file and the field, never a traceback and never a silently wrong
model: Meta's params.json and consolidated.NN.pth, config.json's family and RoPE fields, GGUF metadata and
tokenizer ids, chat_template.jinja, and paths that are not checkpoints at all (tests/test_faults.py holds
config.json's plain field checks).

Each class of fault is held by a parametrized test over the cases of that kind.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ckpt_writers import (byte_bpe_tokenizer, gguf_tokenizer_metadata, random_state_dict,  # noqa: E402
                           sentencepiece_model, sp_gguf_tokenizer_metadata, tiny_config, write_gguf,
                           write_meta_dir)
from _faults import ckpt, inputs, one_line_error, run_tool  # noqa: E402,F401  (fixtures)
from minillama import cli  # noqa: E402
from minillama.weights import WeightsError, load_model  # noqa: E402

DROP = object()  # a field to leave out


def _one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for word in words:
        assert word in msg, msg
    return msg


def _cli_error(capsys, model: Path, inputs: dict) -> str:
    code = cli.main([str(a) for a in ["--model", model, "--doc", inputs["doc"], "--questions", inputs["questions"],
                                      "-n", "2"]])
    return one_line_error((code, capsys.readouterr().err))


# --- Meta directories: params.json's fields and the consolidated.NN.pth shards ----------------------------


@pytest.fixture(scope="module")
def meta_dir(tmp_path_factory) -> Path:
    config = tiny_config(vocab=512)
    return write_meta_dir(tmp_path_factory.mktemp("m") / "meta", config, random_state_dict(config),
                          sentencepiece_model())


def _meta_copy(meta_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(meta_dir, tmp_path / "meta"))


BAD_PARAMS = {
    "multiple_of 0": ({"multiple_of": 0}, "multiple_of must be in 1 .."),
    "multiple_of a string": ({"multiple_of": "32"}, "multiple_of must be an integer"),
    "ffn_dim_multiplier infinite": ({"ffn_dim_multiplier": float("inf")}, "ffn_dim_multiplier must be a finite number"),
    "ffn_dim_multiplier 1e308": ({"ffn_dim_multiplier": 1e308}, "ffn_dim_multiplier 1e+308 makes the feed-forward width"),
    "ffn_dim_multiplier a string": ({"ffn_dim_multiplier": "1.3"}, "ffn_dim_multiplier must be a finite number"),
    "no dim": ({"dim": DROP}, "missing dim"),
    "no n_layers": ({"n_layers": DROP}, "missing n_layers"),
    "dim a string": ({"dim": "64"}, "dim must be an integer, got '64'"),
    "n_heads a float": ({"n_heads": 4.0}, ": n_heads must be an integer, got 4.0"),
    # 0 read as unset (n_heads), and k_proj's shape was blamed
    "n_kv_heads 0": ({"n_kv_heads": 0}, ": n_kv_heads must be in 1 .. 2147483647, got 0"),
    "vocab_size a string": ({"vocab_size": "abc"}, "vocab_size must be an integer (-1: the tokenizer's), got 'abc'"),
    # "false" as a string was true: Llama 3's RoPE scaling on a model that has none
    "use_scaled_rope a string": ({"use_scaled_rope": "false"}, 'use_scaled_rope must be true or false, got "false"'),
    "use_scaled_rope a number": ({"use_scaled_rope": 1}, "use_scaled_rope must be true or false, got 1"),
    "rope_scaling_factor a string": ({"use_scaled_rope": True, "rope_scaling_factor": "8"}, "factor"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_every_bad_params_json_value_is_one_line_naming_the_field(meta_dir, tmp_path, case):
    d = _meta_copy(meta_dir, tmp_path)
    change, word = BAD_PARAMS[case]
    params = {**json.loads((d / "params.json").read_text()), **change}
    (d / "params.json").write_text(json.dumps({k: v for k, v in params.items() if v is not DROP}))
    with pytest.raises(WeightsError) as e:
        load_model(d)
    assert _one_line(e, word).startswith(f"{d / 'params.json'}: ")


BAD_SHARDS = {
    "a list": ([1, 2], "not a Meta checkpoint (a dict of tensor names to tensors), it holds a list"),
    "a bare tensor": (torch.zeros(3), "it holds a Tensor"),
    "integer values": ({"tok_embeddings.weight": 5}, "it maps 'tok_embeddings.weight' to a value of type int"),
    "integer keys": ({5: torch.zeros(2)}, "it maps 5 to a value of type Tensor"),
    "no tensors": ({}, "holds no tensors"),
}


@pytest.mark.parametrize("case", list(BAD_SHARDS))
def test_a_consolidated_pth_that_is_not_a_dict_of_tensors_is_one_line_naming_it(meta_dir, tmp_path, case):
    d = _meta_copy(meta_dir, tmp_path)
    value, word = BAD_SHARDS[case]
    torch.save(value, d / "consolidated.00.pth")
    with pytest.raises(WeightsError) as e:
        load_model(d)
    msg = _one_line(e, word)
    assert msg.startswith(f"{d / 'consolidated.00.pth'}: ") and "params.json" not in msg


def test_the_cli_names_a_bad_meta_shard_and_a_bad_params_field(meta_dir, tmp_path, inputs, capsys):
    d = _meta_copy(meta_dir, tmp_path)
    torch.save([1, 2], d / "consolidated.00.pth")
    assert _cli_error(capsys, d, inputs).endswith("consolidated.00.pth: not a Meta checkpoint (a dict of tensor "
                                                  "names to tensors), it holds a list")
    d = _meta_copy(meta_dir, tmp_path / "b")
    (d / "params.json").write_text(json.dumps({**json.loads((d / "params.json").read_text()), "multiple_of": 0}))
    assert "params.json: multiple_of must be in 1 .." in _cli_error(capsys, d, inputs)


@pytest.fixture(scope="module")
def meta_dir2(tmp_path_factory) -> Path:
    config = tiny_config(vocab=512)
    return write_meta_dir(tmp_path_factory.mktemp("m2") / "meta", config, random_state_dict(config),
                          sentencepiece_model(), shards=2)


WQ = "layers.0.attention.wq.weight"
# shards (the change is to the last) -> {key: tensor, or None to drop}, and the line after the file's name.
# The Q/K rows were permuted before the shapes were checked (a traceback from reshape), and torch.cat joined
# the shards' pieces unchecked; past shard 0, tensors only there were dropped and replicated ones never read.
BAD_META_TENSORS = {
    "wq 63 rows": (1, {WQ: torch.zeros(63, 64)}, "tensor model.layers.0.self_attn.q_proj.weight has shape "
                   "(63, 64) but the config implies (64, 64) (config and weights do not match)"),
    "wq 8 rows": (1, {WQ: torch.zeros(8, 64)}, "tensor model.layers.0.self_attn.q_proj.weight has shape (8, 64) "
                  "but the config implies (64, 64) (config and weights do not match)"),
    "wq a scalar": (1, {WQ: torch.tensor(1.0)}, "tensor model.layers.0.self_attn.q_proj.weight has shape () but "
                    "the config implies (64, 64) (config and weights do not match)"),
    "pieces that do not join": (2, {WQ: torch.zeros(32, 65)}, f"tensor {WQ!r} has shape (32, 65), which does not "
                                "join consolidated.00.pth's (32, 64) along dimension 0"),
    "a 1-D piece of a 2-D tensor": (2, {WQ: torch.zeros(64)}, f"tensor {WQ!r} has shape (64,), which does not "
                                    "join consolidated.00.pth's (32, 64) along dimension 0"),
    "a tensor only in shard 1": (2, {"layers.0.attention.bogus": torch.zeros(4)}, "tensor "
                                 "'layers.0.attention.bogus' is not in consolidated.00.pth (every shard holds every "
                                 "tensor)"),
    "a tensor missing from shard 1": (2, {"norm.weight": None}, "tensor 'norm.weight' is missing "
                                      "(consolidated.00.pth holds it)"),
    "a norm's shape in shard 1": (2, {"norm.weight": torch.ones(65)}, "tensor 'norm.weight' has shape (65,) but "
                                  "consolidated.00.pth holds it with shape (64,) (a replicated tensor is the same "
                                  "in every shard)"),
    "a norm's values in shard 1": (2, {"norm.weight": torch.full((64,), 2.0)}, "tensor 'norm.weight' differs from "
                                   "consolidated.00.pth's copy (a replicated tensor is the same in every shard)"),
}


def _bad_meta(meta_dirs: tuple[Path, Path], tmp_path: Path, case: str) -> tuple[Path, str]:
    """A copy of the one- or two-shard directory with the case's change, and the line its loading must raise."""
    shards, change, line = BAD_META_TENSORS[case]
    d = _meta_copy(meta_dirs[shards - 1], tmp_path)
    f = d / f"consolidated.{shards - 1:02d}.pth"
    part = {**torch.load(f, weights_only=True), **change}
    torch.save({k: v for k, v in part.items() if v is not None}, f)
    return d, f"{d if 'config' in line else f}: {line}"


@pytest.mark.parametrize("case", list(BAD_META_TENSORS))
def test_a_bad_or_disagreeing_meta_shard_tensor_is_one_line_naming_it(meta_dir, meta_dir2, tmp_path, case):
    d, line = _bad_meta((meta_dir, meta_dir2), tmp_path, case)
    with pytest.raises(WeightsError) as e:
        load_model(d)
    assert _one_line(e) == line


def test_weights_info_names_disagreeing_meta_shards(meta_dir, meta_dir2, tmp_path):
    d, line = _bad_meta((meta_dir, meta_dir2), tmp_path, "a norm's shape in shard 1")
    assert one_line_error(run_tool("weights", "info", d)) == f"error: {line}"


# --- config.json: the family's fields and every rope_scaling field, by type, at load ------------------------

QWEN_WINDOW = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
BAD_HF = {
    "model_type a list": ({"model_type": ["llama"]}, "unsupported model_type ['llama']"),
    "rope_parameters a list": ({"rope_parameters": [{"rope_theta": 5.0}]}, "rope_parameters must be an object or null"),
    "rope_parameters a string": ({"rope_parameters": "llama3"}, "rope_parameters must be an object or null, got 'llama3'"),
    "layer_types of objects": ({**QWEN_WINDOW, "layer_types": [{"a": 1}]}, "layer_types must be a list of"),
    "layer_types a number": ({**QWEN_WINDOW, "layer_types": 5}, "layer_types must be a list of"),
    "max_window_layers a string": ({**QWEN_WINDOW, "max_window_layers": "x"}, "max_window_layers must be an integer"),
    "use_sliding_window a string": ({**QWEN_WINDOW, "use_sliding_window": "false"},
                                    "use_sliding_window must be true or false"),
    "attention_bias a string": ({"attention_bias": "false"}, "attention_bias must be true or false"),
    "rope type a list": ({"rope_parameters": {"rope_type": ["x"]}}, "unsupported rope_scaling type ['x']"),
    "yarn original context a string": ({"rope_scaling": {**YARN, "original_max_position_embeddings": "x"}},
                                       "rope_scaling.original_max_position_embeddings must be an integer"),
    "yarn beta_fast a string": ({"rope_scaling": {**YARN, "beta_fast": "x"}}, "rope_scaling.beta_fast must be"),
    "yarn beta_slow negative": ({"rope_scaling": {**YARN, "beta_slow": -1}}, "rope_scaling.beta_slow must be"),
    "yarn attention_factor a string": ({"rope_scaling": {**YARN, "attention_factor": "y"}},
                                       "rope_scaling.attention_factor must be"),
    "yarn mscale a string": ({"rope_scaling": {**YARN, "mscale": "x", "mscale_all_dim": 1.0}},
                             "rope_scaling.mscale must be"),
    "yarn truncate a string": ({"rope_scaling": {**YARN, "truncate": "no"}}, "rope_scaling.truncate must be"),
    "linear factor infinite": ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}},
                               "rope_scaling.factor must be a finite number"),
    "dynamic factor a bool": ({"rope_scaling": {"rope_type": "dynamic", "factor": True}},
                              "rope_scaling.factor must be a finite number"),
    "sliding_window past int64-safe": ({"model_type": "mistral", "sliding_window": 10**30},
                                       "sliding_window must be a positive integer (at most 2147483647)"),
}


def _hf_copy(ckpt: Path, tmp_path: Path, change: dict) -> Path:
    d = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **change}))
    return d


def test_a_corrupt_safetensors_header_under_tp_is_one_line_naming_the_file(ckpt, tmp_path, inputs, capsys):
    """`--tp` reads the config (and a tie's tensors) before any rank starts: a header that is a JSON list was an
    AttributeError traceback there, where one process says the file is corrupt."""
    d = _hf_copy(ckpt, tmp_path, {})
    (d / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"[]")
    code = cli.main([str(a) for a in ["--model", d, "--doc", inputs["doc"], "--questions", inputs["questions"],
                                      "-n", "2", "--tp", "2", "--procs", "2"]])
    err = one_line_error((code, capsys.readouterr().err))
    assert f"{d / 'model.safetensors'}: truncated or corrupt safetensors file" in err, err


@pytest.mark.parametrize("case", list(BAD_HF))
def test_every_bad_family_or_rope_field_is_refused_at_load_naming_it(ckpt, tmp_path, case):
    change, word = BAD_HF[case]
    d = _hf_copy(ckpt, tmp_path, change)
    with pytest.raises(WeightsError) as e:
        load_model(d)
    assert _one_line(e, word).startswith(f"{d / 'config.json'}: ")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
@pytest.mark.parametrize("kind, says", [("fifo", "a fifo (named pipe)"), ("device", "a device"),
                                        ("directory", "a directory"), ("loop", "a symlink loop"),
                                        ("dangling", "a symlink to nothing (no such file or directory)")])
def test_a_file_of_a_checkpoint_that_is_no_regular_file_is_named(ckpt, tmp_path, name, kind, says):
    """A fifo would block the read for ever, a device (/dev/zero) never end; a directory, a loop or a link to
    nothing read as a missing shard or no checkpoint at all. Each: one line naming the file and what it is."""
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    f = d / name
    f.unlink()
    {"fifo": lambda: os.mkfifo(f), "device": lambda: f.symlink_to("/dev/zero"), "directory": f.mkdir,
     "loop": lambda: f.symlink_to(f), "dangling": lambda: f.symlink_to(d / "nothing")}[kind]()
    with pytest.raises(WeightsError) as e:
        load_model(d)
    assert str(e.value) == f"{f}: {says}, where a file belongs"


def _without_root_reads() -> None:
    """In a child before it runs: drop the capabilities by which root reads any file (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH) from its bounding set, so a file of mode 0 is unreadable to it too."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_file_of_a_checkpoint_without_read_permission_is_named(ckpt, tmp_path, name):
    """A file the user may not read was reported as a truncated or corrupt one (the safetensors parser's error)."""
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    (d / name).chmod(0)
    code = ("import sys; from minillama.errors import run_command; from minillama.weights import load_model; "
            f"sys.exit(run_command(lambda: (load_model({str(d)!r}), 0)[1]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                         preexec_fn=_without_root_reads if os.geteuid() == 0 else None)
    assert (run.returncode, run.stderr) == (2, f"error: {d / name}: cannot be read (Permission denied)\n")


def test_files_under_a_folder_not_named_in_utf8_are_read(ckpt, tmp_path, inputs):
    """A checkpoint, and a record `oracle export` wrote, under a folder named in Latin-1 ("m\\xff"): safetensors
    opens only UTF-8 paths, and the fine files were called "truncated or corrupt"."""
    d = tmp_path / os.fsdecode(b"m\xff")
    shutil.copytree(ckpt, d)
    (model, tok), (model0, tok0) = load_model(d), load_model(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model0.state_dict().values(), strict=True))
    assert tok.encode("The tower is tall.") == tok0.encode("The tower is tall.")
    record = d / "r.safetensors"
    exported = run_tool("oracle", "export", "-m", str(d), "--doc", inputs["doc"], "--questions", inputs["questions"],
                        "-n", "2", "-o", str(record), errors="replace")
    assert exported.returncode == 0, exported.stderr
    compared = run_tool("oracle", "compare", "--reference", str(record), "--candidate", str(record), errors="replace")
    assert compared.returncode == 0, compared.stderr


def test_a_window_past_the_context_is_no_window(ckpt, tmp_path):
    import minillama

    replies = {}
    for window in (None, 2**31 - 1):
        d = _hf_copy(ckpt, tmp_path / str(window), {"model_type": "mistral", "sliding_window": window})
        replies[window] = [r.token_ids for r in minillama.ask(minillama.load(d), "The bridge was built in 1932.",
                                                              ["Who built it?"], max_new_tokens=3)]
    assert replies[None] == replies[2**31 - 1]


def test_the_cli_names_a_bad_rope_field(ckpt, tmp_path, inputs, capsys):
    d = _hf_copy(ckpt, tmp_path, {"rope_scaling": {**YARN, "beta_fast": "x"}})
    assert "config.json: rope_scaling.beta_fast must be a finite number >= 0, got 'x'" in _cli_error(capsys, d, inputs)


# --- GGUF: metadata of the wrong type, and tokenizer ids and merges past the vocabulary ---------------------


@pytest.fixture
def gguf_values(monkeypatch):
    """Metadata values to write in place of the writer's own: key -> (value, GGUFValueType[, sub type])."""
    import gguf

    values: dict = {}
    write = gguf.GGUFWriter.add_key_value

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key in values:
            val, vtype, *sub = values[key]
            sub_type = sub[0] if sub else None
        return write(self, key, val, vtype, sub_type)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add_key_value)
    return values


def _sp_tok(**change) -> dict:
    return {**sp_gguf_tokenizer_metadata(sentencepiece_model()), **change}


def _bpe_tok(**change) -> dict:
    return {**gguf_tokenizer_metadata(byte_bpe_tokenizer()), **change}


BAD_GGUF = {  # tokenizer values, metadata written in place of the writer's, extra keys, expected words
    "sentencepiece bos past the tokens": ("sp", {"bos": 100000}, {}, {},
                                          "tokenizer.ggml.bos_token_id 100000 is not a token id"),
    "sentencepiece eos past the tokens": ("sp", {"eos": 100000}, {}, {},
                                          "tokenizer.ggml.eos_token_id 100000 is not a token id"),
    "gpt2 bos past the tokens": ("bpe", {"bos": 100000}, {}, {}, "tokenizer.ggml.bos_token_id 100000 is not a token id"),
    "gpt2 merge of three tokens": ("bpe", {"merges": ["a b c", "zz"]}, {}, {},
                                   "tokenizer.ggml.merges[0] 'a b c' is not two tokens joined by one space"),
    "gpt2 merge of one token": ("bpe", {"merges": ["zz"]}, {}, {}, "tokenizer.ggml.merges[0] 'zz' is not two tokens"),
    "token types short": ("bpe", {"types": [1, 1]}, {}, {}, "tokenizer.ggml.token_type has 2 entries for"),
    "rope.dimension_count a string": ("bpe", {}, {"llama.rope.dimension_count": ("16", "STRING")}, {},
                                      "llama.rope.dimension_count must be an integer >= 1, got '16'"),
    "rope.dimension_count past the head": ("bpe", {}, {"llama.rope.dimension_count": (8, "UINT32")}, {},
                                           "llama.rope.dimension_count 8 is not the head dim 16: partial RoPE"),
    "key_length 0": ("bpe", {}, {}, {"llama.attention.key_length": 0},
                     "llama.attention.key_length must be an integer >= 1, got 0"),
    "head_count 0": ("bpe", {}, {"llama.attention.head_count": (0, "UINT32")}, {},
                     "llama.attention.head_count must be an integer >= 1, got 0"),
    "freq_base a string": ("bpe", {}, {"llama.rope.freq_base": ("x", "STRING")}, {},
                           "llama.rope.freq_base must be a number, got 'x'"),
    # a flag or type the file spells otherwise would change the prompt's tokens, not be refused
    "add_bos_token a string": ("sp", {}, {"tokenizer.ggml.add_bos_token": ("false", "STRING")}, {},
                               "tokenizer.ggml.add_bos_token must be a boolean, got 'false'"),
    "gpt2 add_bos_token a string": ("bpe", {}, {"tokenizer.ggml.add_bos_token": ("false", "STRING")}, {},
                                    "tokenizer.ggml.add_bos_token must be a boolean, got 'false'"),
    "add_eos_token a string": ("sp", {}, {}, {"tokenizer.ggml.add_eos_token": "no"},
                               "tokenizer.ggml.add_eos_token must be a boolean, got 'no'"),
    "add_space_prefix a number": ("sp", {}, {}, {"tokenizer.ggml.add_space_prefix": 1},
                                  "tokenizer.ggml.add_space_prefix must be a boolean, got 1"),
    "gpt2 without merges": ("bpe", {"merges": None}, {}, {},
                            "tokenizer.ggml.merges missing: a gpt2 (byte-level BPE) tokenizer needs its merges"),
    "token types as strings": ("bpe", {"types": lambda t: [str(x) for x in t]}, {}, {},
                               "tokenizer.ggml.token_type holds '3', not a token type (0 to 6)"),
    "a token type past the last": ("sp", {"types": lambda t: t[:-1] + [99]}, {}, {},
                                   "tokenizer.ggml.token_type holds 99, not a token type (0 to 6)"),
    "gpt2 merges a number": ("bpe", {}, {"tokenizer.ggml.merges": (5, "UINT32")}, {},
                             "tokenizer.ggml.merges must be a list, got 5"),
    "tokens a string": ("sp", {}, {"tokenizer.ggml.tokens": ("abc", "STRING")}, {},
                        "tokenizer.ggml.tokens must be a list, got 'abc'"),
    "scores as strings": ("sp", {"scores": lambda t: [str(x) for x in t]}, {}, {},
                          "tokenizer.ggml.scores holds '0.0', not a number"),
}


def _bad_gguf(path: Path, gguf_values: dict, case: str) -> Path:
    from gguf import GGUFValueType

    kind, tok_change, values, extra, _ = BAD_GGUF[case]
    tok = _sp_tok() if kind == "sp" else _bpe_tok()
    tok.update({k: change(tok[k]) if callable(change) else change for k, change in tok_change.items()})
    tok = {k: v for k, v in tok.items() if v is not None}  # None: the key left out
    gguf_values.update({k: (v, GGUFValueType[t]) for k, (v, t) in values.items()})
    config = tiny_config(vocab=len(tok["tokens"]))
    return write_gguf(path, config, random_state_dict(config), tok, extra=extra)


@pytest.mark.parametrize("case", list(BAD_GGUF))
def test_every_bad_gguf_value_is_one_line_naming_the_key(tmp_path, gguf_values, case):
    path = _bad_gguf(tmp_path / "m.gguf", gguf_values, case)
    with pytest.raises(WeightsError) as e:
        load_model(path)
    assert _one_line(e, BAD_GGUF[case][-1]).startswith(f"{path}: ")


@pytest.mark.parametrize("moved", ["misaligned", "a block on", "onto the first tensor"])
def test_a_tensor_whose_data_is_not_where_the_ones_before_it_end_is_refused(tmp_path, moved):
    """Each tensor's data follows the one before it, aligned; an offset anywhere else reads another tensor's
    bytes or a gap as weights, which load and answer (llama.cpp refuses such a file): one line naming it."""
    from gguf import GGUFReader

    tok = _bpe_tok()
    config = tiny_config(vocab=len(tok["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", config, random_state_dict(config), tok)
    reader = GGUFReader(str(path), "r+")
    t = reader.tensors[2]
    place = int(t.field.parts[-1][0])
    t.field.parts[-1][0] = {"misaligned": place + 4, "a block on": place + 32, "onto the first tensor": 0}[moved]
    reader.data.flush()
    del reader, t
    with pytest.raises(WeightsError) as e:
        load_model(path)
    found = {"misaligned": place + 4, "a block on": place + 32, "onto the first tensor": 0}[moved]
    assert _one_line(e, f"has offset {found}, expected {place}").startswith(f"{path}: corrupt GGUF file (tensor ")


@pytest.mark.parametrize("factors", [np.ones(3), np.ones((2, 8))])
def test_rope_freqs_of_another_shape_than_the_heads_pairs_is_one_line(tmp_path, factors):
    tok = _bpe_tok()
    config = tiny_config(vocab=len(tok["tokens"]))  # head dim 16: 8 pairs
    path = write_gguf(tmp_path / "m.gguf", config, random_state_dict(config), tok, rope_freqs=factors)
    with pytest.raises(WeightsError) as e:
        load_model(path)
    assert _one_line(e, f"rope_freqs.weight has shape {factors.shape}, expected (8,)").startswith(f"{path}: ")


def test_the_cli_names_a_gguf_tokenizer_id_past_the_tokens(tmp_path, gguf_values, inputs, capsys):
    path = _bad_gguf(tmp_path / "m.gguf", gguf_values, "gpt2 bos past the tokens")
    assert "m.gguf: tokenizer.ggml.bos_token_id 100000 is not a token id" in _cli_error(capsys, path, inputs)



@pytest.mark.parametrize("field, text", [("tokenizer.ggml.tokens", b"<|im_start|>"), ("general.name", b"NAMEMARK")])
def test_a_gguf_string_that_is_not_utf8_is_one_line_naming_the_key(tmp_path, inputs, capsys, field, text):
    """gguf-py decodes a string when it is read, strictly: a byte that is no UTF-8 was a UnicodeDecodeError
    traceback from loading, from the tokenizer alone and from `weights info`."""
    from minillama.tokenizer import TokenizerError, load_tokenizer

    tok = _bpe_tok()
    config = tiny_config(vocab=len(tok["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", config, random_state_dict(config), tok, extra={"general.name": "NAMEMARK"})
    data = bytearray(path.read_bytes())
    data[data.index(text, data.index(field.encode()))] = 0xFF
    path.write_bytes(data)
    says = f"{path}: field {field} is not valid UTF-8"
    with pytest.raises(WeightsError) as e:
        load_model(path)
    assert _one_line(e).startswith(says)
    assert says in _weights_error(capsys, "info", str(path))
    assert says in _cli_error(capsys, path, inputs)
    if field.startswith("tokenizer."):
        with pytest.raises(TokenizerError) as e:
            load_tokenizer(path)
        assert _one_line(e, "(string 1: b'\\xff|im_start|>')").startswith(says)

# --- a chat_template.jinja that is not UTF-8 text -------------------------------------------------------


@pytest.mark.parametrize("content", [b"{{ messages }}\xff\xfe", None], ids=["not UTF-8", "a directory"])
def test_an_unreadable_chat_template_jinja_is_one_line_naming_it(ckpt, tmp_path, inputs, capsys, content):
    d = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if content is None:
        (d / "chat_template.jinja").mkdir()
    else:
        (d / "chat_template.jinja").write_bytes(content)
    says = "not a readable UTF-8 file" if content is not None else "a directory, where a file belongs"
    with pytest.raises(WeightsError) as e:
        load_model(d)
    assert _one_line(e).startswith(f"{d / 'chat_template.jinja'}: {says}")
    assert f"chat_template.jinja: {says}" in _cli_error(capsys, d, inputs)


# --- paths that are not checkpoints: an empty path, a fifo, a symlink loop ---------------------------------


def _weights_error(capsys, *args: str) -> str:
    from minillama.weights.cli import main

    code = main(list(args))
    return one_line_error((code, capsys.readouterr().err))


@pytest.mark.parametrize("args", [("info", ""), ("convert", "SRC", ""), ("convert", "", "OUT")],
                         ids=["info", "convert to", "convert from"])
def test_an_empty_path_is_refused_by_the_weights_tool(ckpt, tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)  # were "" the working directory, a conversion would write here
    args = [str(ckpt) if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert "an empty" in _weights_error(capsys, *args) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "symlink loop"])
def test_a_path_that_is_not_a_checkpoint_says_what_it_is(tmp_path, capsys, inputs, kind):
    path = tmp_path / "model"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "other", path)
        os.symlink(path, tmp_path / "other")
    with pytest.raises(WeightsError, match=re.escape(f"{path}: a {kind}")):
        load_model(path)
    assert f"model: a {kind}" in _weights_error(capsys, "info", str(path))
    assert f"model: a {kind}" in _cli_error(capsys, path, inputs)  # a loop once read "no such file or directory"

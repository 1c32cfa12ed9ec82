"""A checkpoint's tokenizer: from an HF or Meta directory (with its tokenizer_config.json, chat template and
end-of-sequence ids), a single tokenizer file, or a GGUF file (its `tokenizer.ggml.*` metadata: gguf_vocab.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .base import Tokenizer, TokenizerError, check_template
from .bpe import (HFTokenizer, _unique, bos_eos_processor, llama_class_tokenizer, qwen2_class_tokenizer,
                  read_tokenizer_json)
from .gguf_vocab import _is_id, read_gguf_tokenizer_metadata, tokenizer_from_gguf_metadata
from .spm import SentencePieceTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF or Meta directory, a .gguf file, a tokenizer.json or a
    sentencepiece tokenizer.model."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return tokenizer_from_gguf_metadata(read_gguf_tokenizer_metadata(p), str(p))
    if p.is_file() and p.name.endswith(".json"):
        return HFTokenizer.from_file(p)
    if p.is_file():
        return SentencePieceTokenizer.from_file(p)
    if not p.is_dir():
        raise TokenizerError(f"{p}: no such file or directory")
    cfg_path = p / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    _check_config(cfg, cfg_path)
    template, template_source = _chat_template(p, cfg)
    eos_ids = _eos_ids_from_configs(p)
    stm_path = p / "special_tokens_map.json"
    stm = _read_json(stm_path) if stm_path.exists() else {}
    given = _special_tokens(cfg, stm, stm_path)
    # HF's routing where tokenizer.json is read; beside a tokenizer.model alone, the class tokenizer_config.json names
    json_file = (p / "tokenizer.json").exists()
    named = (hf_tokenizer_class(p, cfg) if json_file else str(cfg.get("tokenizer_class"))).removesuffix("Fast")
    code_llama = named == "CodeLlamaTokenizer" and json_file
    llama_class = named == "LlamaTokenizer" or code_llama
    qwen2_class = json_file and named == "Qwen2Tokenizer"
    if llama_class:  # the class's defaults, for a token neither file names (null names none)
        given = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", **given}
    if qwen2_class:
        given = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", **given}
    bos, eos = given.get("bos_token"), given.get("eos_token")
    if json_file:
        lib = read_tokenizer_json(p / "tokenizer.json")
        if llama_class:  # CodeLlama's "▁" goes before the whole text only, whatever `legacy` says
            scheme = prepend_scheme({**cfg, "legacy": False} if code_llama else cfg)
            lib = llama_class_tokenizer(lib, scheme, keep_added="added_tokens_decoder" not in cfg,
                                        code_llama=code_llama, unk_token=given.get("unk_token"))
        if qwen2_class:
            lib = qwen2_class_tokenizer(lib, bool(cfg.get("add_prefix_space")), "added_tokens_decoder" not in cfg)
        infill = [cfg.get(f"{k}_token", f"\u2581<{k[:3].upper()}>") for k in ("prefix", "middle", "suffix", "eot")]
        lib.add_tokens(_config_added_tokens(cfg, stm, given, cfg_path, lib,  # CodeLlama's infilling tokens
                                            [*infill, cfg.get("fill_token", "<FILL_ME>")] if code_llama else ()))
        if code_llama:  # the class writes its own: BOS by its add_bos_token, true (HF drops the config's field)
            lib.post_processor = bos_eos_processor(lib, bos, None)
        tok = HFTokenizer(lib, bos_token=bos, eos_tokens=[eos] if eos else [],
                          extra_eos_ids=list(cfg.get("eos_token_ids") or []) + eos_ids, chat_template=template,
                          add_bos=cfg.get("add_bos_token"), add_eos=cfg.get("add_eos_token"))
        tok.source = str(p / "tokenizer.json")
        tok.eos_token = eos  # what templates see: the config's text, none when it gives none (as HF renders)
    elif (p / "tokenizer.model").exists():
        tok = SentencePieceTokenizer.from_file(p / "tokenizer.model", add_bos=cfg.get("add_bos_token", True),
                                               add_eos=cfg.get("add_eos_token", False), chat_template=template,
                                               added=_added_tokens(p, cfg, stm, given),
                                               prepend_scheme=prepend_scheme(cfg) if llama_class else None)
        if bos is not None and tok.token_to_id(bos) is not None:
            tok.bos_id = tok.token_to_id(bos)
        extra = [tok.token_to_id(eos)] if eos is not None and tok.token_to_id(eos) is not None else []
        tok.eos_ids = _unique(extra + tok.eos_ids + list(cfg.get("eos_token_ids") or []) + eos_ids)
        for field in ("bos_token", "eos_token"):  # what templates see: the model's own pieces unless given
            if field in given:
                setattr(tok, field, given[field])
    else:
        raise TokenizerError(f"{p}: no tokenizer (looked for tokenizer.json and tokenizer.model)")
    if bos is not None and cfg.get("add_bos_token") and tok.token_to_id(bos) is None:
        raise TokenizerError(f'{cfg_path}: "bos_token" {bos!r} is not a token of the tokenizer, and '
                             f'"add_bos_token" is true: no BOS could be added')
    tok.named_tokens = {k: v for k, v in given.items() if k not in ("bos_token", "eos_token") and v is not None}
    tok.split_special = bool(cfg.get("split_special_tokens"))  # as HF: control tokens written in any text are text
    if template is not None:
        tok.template_source = template_source
        check_template(template, template_source)  # a syntax error is found now, before any work
    tok.tool_template = _tool_template(p, cfg)
    return tok


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: must be a JSON object, got a {type(d).__name__}")
    return d


# The special tokens HF transformers names (`SPECIAL_TOKENS_ATTRIBUTES`); each is a variable of the chat template.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(cfg: dict[str, Any], stm: dict[str, Any], path: Path) -> dict[str, str | None]:
    """The named special tokens, name -> text (None: none), as HF transformers reads them: NAMED_TOKENS and any
    other "..._token" given as a token (a model's own, "image_token"), from tokenizer_config.json (`cfg`), and
    from special_tokens_map.json (`stm`, read from `path`; older checkpoints keep them there), whose tokens win,
    but which HF reads only where the config has no added_tokens_decoder. A token neither gives is absent."""
    if "added_tokens_decoder" in cfg:
        stm = {}
    _check_config({k: stm[k] for k in NAMED_TOKENS if k in stm}, path)
    return {k: _token_text(src[k]) for src in (cfg, stm) for k in src
            if k in NAMED_TOKENS or (k.endswith("_token") and _is_token(src[k], src is stm))}


def _is_token(value: Any, in_map: bool) -> bool:
    """Whether a "..._token" field that HF does not name holds a token: a string, or an AddedToken object (in
    tokenizer_config.json marked "__type": "AddedToken", as HF writes it there; add_bos_token is a flag)."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str) and
                                      (in_map or value.get("__type") == "AddedToken"))


def _added_tokens(d: Path, cfg: dict[str, Any], stm: dict[str, Any],
                  given: dict[str, str | None]) -> dict[int, tuple[str, bool]]:
    """The tokens an HF directory adds to its tokenizer.model, id -> (text, special): tokenizer_config.json's
    added_tokens_decoder, and added_tokens.json (older; {text: id}), whose tokens are special where
    special_tokens_map.json lists them or they are BOS or EOS. TokenizerError naming the file and field."""
    out: dict[int, tuple[str, bool]] = {}
    path = d / "tokenizer_config.json"
    for i, tok in _decoder_entries(cfg, path).items():
        out[i] = (tok["content"], tok.get("special", False))
    if (d / "added_tokens.json").exists():
        extra = _read_json(d / "added_tokens.json")
        named = {_token_text(t) for t in stm.get("additional_special_tokens") or [] if isinstance(t, (str, dict))}
        for text, i in extra.items():
            if not _is_id(i):
                raise TokenizerError(f"{d / 'added_tokens.json'}: must map token texts to ids, got "
                                     f"{json.dumps({text: i})[:80]}")
            out.setdefault(i, (text, text in named or text in [given.get(k) for k in NAMED_TOKENS]))
    return out


ADDED_TOKEN_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")


def _decoder_entries(cfg: dict[str, Any], path: Path) -> dict[int, dict[str, Any]]:
    """tokenizer_config.json's added_tokens_decoder, id -> {"content": ..., "special": ..., ...}, each checked:
    TokenizerError naming the file and the field."""
    out: dict[int, dict[str, Any]] = {}
    for key, tok in (cfg.get("added_tokens_decoder") or {}).items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(tok, dict) and isinstance(tok.get("content"), str)
                and all(isinstance(tok.get(f, False), bool) for f in ADDED_TOKEN_FLAGS)):
            raise TokenizerError(f'{path}: "added_tokens_decoder" must map ids to {{"content": "...", "special": '
                                 f"true/false}}, got {json.dumps({key: tok})[:80]}")
        out[int(key)] = tok
    return out


def _config_added_tokens(cfg: dict[str, Any], stm: dict[str, Any], given: dict[str, str | None], path: Path,
                         lib: Any, more: Sequence[Any] = ()) -> list[Any]:
    """The tokens HF transformers adds to a tokenizer.json's tokenizer `lib` when it loads the directory, in its
    order (`TokenizersBackend.__init__`): every entry of added_tokens_decoder with the flags the config gives (a
    token the file has as ordinary, the config may make special), then as special each named special token
    (`given`) and additional_special_tokens entry (`stm`'s where HF reads the map) that is neither an added token
    of the file nor among those. Adding a token the tokenizer has changes only its flags. One that is no token of
    the vocabulary is left out: HF appends it with a new id, past the vocabulary the model was trained with.
    `more`: the special tokens a class adds (CodeLlama's infilling tokens), after all those."""
    from tokenizers import AddedToken

    named = [v for v in given.values() if v is not None]  # HF makes an entry that is a named token special
    entries = [AddedToken(t["content"], **{**{f: t[f] for f in ADDED_TOKEN_FLAGS if f in t},
                                           **({"special": True} if t["content"] in named else {})})
               for _, t in sorted(_decoder_entries(cfg, path).items())]
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
    stm = {} if "added_tokens_decoder" in cfg else stm
    extra = [*(extra if isinstance(extra, list) else []), *(stm.get("additional_special_tokens") or [])]
    order = [*NAMED_TOKENS, *given]  # HF's named tokens first, a model's own after
    texts = [given[k] for k in sorted(given, key=order.index)] + [_token_text(t) for t in [*extra, *more]]
    have = {t.content for t in lib.get_added_tokens_decoder().values()} | {e.content for e in entries}
    return entries + [AddedToken(t, special=True) for t in dict.fromkeys(texts)
                      if isinstance(t, str) and t not in have and lib.token_to_id(t) is not None]


# How HF transformers 5's AutoTokenizer routes a directory whose files name a tokenizer class, by config.json's
# model_type (its TOKENIZER_MAPPING_NAMES and MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, mistral-common not
# installed), for the model types minillama runs and Mixtral: None, the named class stands (llama has no class
# of its own; qwen3's yields to the named one); a class name, that class whatever the files name (mistral's
# and mixtral's is the tokenizer.json as written; qwen2's named class is held to be wrong). Any other model type
# leaves the named class, as HF does for most.
MODEL_TYPE_TOKENIZER: dict[str, str | None] = {"llama": None, "qwen3": None, "mistral": "TokenizersBackend",
                                               "mixtral": "TokenizersBackend", "qwen2": "Qwen2Tokenizer"}
# The model types whose own class is Qwen2Tokenizer (HF's TOKENIZER_MAPPING_NAMES): Qwen's and models built on Qwen's.
QWEN2_MODEL_TYPES = ("audioflamingo3", "colqwen2", "cosmos3_omni", "dots3_note", "fun_asr_nano", "hunyuan_vl",
                     "internvl", "lighton_ocr", "moss_transcribe_diarize", "ovis2", "qianfan_ocr", "qwen2",
                     "qwen2_5_omni", "qwen2_5_vl", "qwen2_audio", "qwen2_moe", "qwen2_vl", "qwen3", "qwen3_asr",
                     "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl", "qwen3_vl_moe", "vibevoice")


def hf_tokenizer_class(d: Path, cfg: dict[str, Any]) -> str:
    """The class HF transformers 5's AutoTokenizer builds for directory `d` (tokenizer_config.json `cfg`), without
    "Fast": "TokenizersBackend" (tokenizer.json as written) or a class minillama rebuilds as HF does where it is
    "LlamaTokenizer" or "CodeLlamaTokenizer". The class tokenizer_config.json names, else config.json's
    `tokenizer_class`, routed by config.json's `model_type` (MODEL_TYPE_TOKENIZER); but LlamaTokenizer over a
    tokenizer.json that says "ByteLevel" anywhere (HF looks for the quoted word in the file's text) is the file as
    written: the class's Metaspace would garble a byte-level vocabulary. Neither file naming one: the model type's
    own class where it is Qwen2Tokenizer (QWEN2_MODEL_TYPES), else the file as written."""
    model = _read_json(d / "config.json") if (d / "config.json").exists() else {}
    named = cfg.get("tokenizer_class") or model.get("tokenizer_class")
    if not isinstance(named, str):  # the model type's own class, where it is Qwen2's
        return "Qwen2Tokenizer" if model.get("model_type") in QWEN2_MODEL_TYPES else "TokenizersBackend"
    model_type = model.get("model_type")
    routed = MODEL_TYPE_TOKENIZER.get(model_type) if isinstance(model_type, str) else None
    if routed is not None:
        return routed
    tj = d / "tokenizer.json"
    if named.removesuffix("Fast") == "LlamaTokenizer" and tj.exists() and \
            '"ByteLevel"' in tj.read_text(encoding="utf-8", errors="replace"):
        return "TokenizersBackend"
    return named.removesuffix("Fast")


def prepend_scheme(cfg: dict[str, Any]) -> str:
    """Where a Llama-class tokenizer puts "▁" before text, by tokenizer_config.json's `add_prefix_space` (absent:
    true) and `legacy` (absent: false), as HF's `_get_prepend_scheme`: before every text between special
    tokens ("always", legacy), before the start of the whole text only ("first"), or nowhere ("never")."""
    if cfg.get("add_prefix_space") is False:
        return "never"
    return "always" if cfg.get("legacy", False) else "first"


def _token_text(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return tok.get("content") if isinstance(tok, dict) else tok


def _check_config(cfg: dict[str, Any], path: Path) -> None:
    """The fields of tokenizer_config.json minillama reads, each of the type HF transformers writes, or
    TokenizerError naming the file and the field."""
    def bad(field: str, what: str) -> TokenizerError:
        return TokenizerError(f'{path}: "{field}" must be {what}, got {json.dumps(cfg[field])[:80]}')

    for field in NAMED_TOKENS:
        v = cfg.get(field)
        if not (v is None or isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str))):
            raise bad(field, 'a string, an AddedToken object {"content": "..."} or null')
    for field in ("add_bos_token", "add_eos_token", "legacy", "add_prefix_space", "split_special_tokens"):
        if not (cfg.get(field) is None or isinstance(cfg[field], bool)):
            raise bad(field, "true, false or null")
    ids = cfg.get("eos_token_ids")
    if not (ids is None or (isinstance(ids, list) and all(map(_is_id, ids)))):
        raise bad("eos_token_ids", "a list of token ids (integers >= 0)")
    t = cfg.get("chat_template")
    if not (t is None or isinstance(t, str) or (isinstance(t, list) and all(
            isinstance(x, dict) and isinstance(x.get("template"), str) for x in t))):
        raise bad("chat_template", 'a string, a list of {"name": ..., "template": "..."} or null')


def _chat_template(d: Path, cfg: dict[str, Any]) -> tuple[str | None, str]:
    """The chat template and where it was read from (the file and the field): chat_template.jinja, which
    comes before tokenizer_config.json's field as HF transformers takes them, then that field, then a
    processor's chat_template.json."""
    if (d / "chat_template.jinja").exists():
        return _template_file(d / "chat_template.jinja"), str(d / "chat_template.jinja")
    t, where = cfg.get("chat_template"), f"{d / 'tokenizer_config.json'}, field chat_template"
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {x.get("name"): x.get("template") for x in t}
        if "default" not in named:  # as HF transformers: which one to use is not said
            raise TokenizerError(f"{where}: a list of templates, none named \"default\" (named: "
                                 f"{', '.join(map(str, named))[:200]})")
        t = named["default"]
        where += "[default]"
    if t is None and (d / "chat_template.json").exists():
        where = f"{d / 'chat_template.json'}, field chat_template"
        t = _read_json(d / "chat_template.json").get("chat_template")
        if not (t is None or isinstance(t, str)):
            raise TokenizerError(f"{where} must be a string, got {json.dumps(t)[:80]}")
    return t, where


def _template_file(path: Path) -> str:
    """A chat template's .jinja file, or TokenizerError naming it where it is not readable UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not a readable UTF-8 file ({e})") from None


def _tool_template(d: Path, cfg: dict[str, Any]) -> tuple[str, str] | None:
    """The template named "tool_use" and where it was read from: additional_chat_templates/tool_use.jinja where
    the directory holds template files (HF transformers then reads none from tokenizer_config.json), else the
    config's list of templates."""
    path, named = d / "additional_chat_templates" / "tool_use.jinja", cfg.get("chat_template")
    where = f"{d / 'tokenizer_config.json'}, field chat_template[tool_use]"
    t = next((x["template"] for x in named if x.get("name") == "tool_use"), None) if isinstance(named, list) else None
    if (d / "chat_template.jinja").exists() or any((d / "additional_chat_templates").glob("*.jinja")):
        t, where = (_template_file(path) if path.is_file() else None), str(path)
    if t is not None:
        check_template(t, where)  # a syntax error is found now, before any work
    return None if t is None else (t, where)


def _eos_ids_from_configs(d: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if (d / name).exists():
            e = _read_json(d / name).get("eos_token_id")
            e = [] if e is None else e if isinstance(e, list) else [e]
            if not all(map(_is_id, e)):
                raise TokenizerError(f'{d / name}: "eos_token_id" must be a token id or a list of them (integers '
                                     f">= 0), got {json.dumps(_read_json(d / name)['eos_token_id'])[:80]}")
            ids += e
    return _unique(ids)

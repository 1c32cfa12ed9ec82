"""Chat templates render as HF transformers renders them: the templates the Llama family's common checkpoints
ship (tests/chat_templates/*.jinja: Llama 3.1 and 3.2, Qwen2.5 and 3, Mistral v0.3, SmolLM2, the DeepSeek-R1
distills, Gemma 2 and 3), on chats with system turns, tools, tool calls and their results, content parts,
extra keys and non-ASCII text, with and without a generation prompt, each compared with
`AutoTokenizer.apply_chat_template` run in the test. Where HF's rendering raises (a Mistral template refusing
two user turns in a row), minillama's raises a one-line TokenizerError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _ckpt_writers import byte_bpe_tokenizer
from minillama.tokenizer import TokenizerError, load_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
R1 = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
GEMMA = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
# template file -> (bos_token, eos_token, the special tokens its tokenizer declares)
FAMILIES = {
    "llama-3.1": ("<|begin_of_text|>", "<|eot_id|>", LLAMA3),
    "llama-3.2": ("<|begin_of_text|>", "<|eot_id|>", LLAMA3),
    "qwen-2.5": (None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "qwen-3": (None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "mistral-v0.3": ("<s>", "</s>", ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                     "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "smollm2": ("<|im_start|>", "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "deepseek-r1-distill": (R1[0], R1[1], R1),
    "gemma-2": ("<bos>", "<eos>", GEMMA),
    "gemma-3": ("<bos>", "<eos>", GEMMA),
}

SYSTEM = {"role": "system", "content": "Be brief. Réponds en français, 日本語も可"}
USER = {"role": "user", "content": "  What is 2+2? « ça » 🙂  "}
ANSWER = {"role": "assistant", "content": "4."}
AGAIN = {"role": "user", "content": "And 3+3?\nThanks."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The wéather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
CHATS = {
    "user": [USER],
    "system, user": [SYSTEM, USER],
    "turns": [SYSTEM, USER, ANSWER, AGAIN],
    "turns, no system": [USER, ANSWER, AGAIN],
    "two user turns": [USER, AGAIN],
    "system only": [SYSTEM],
    "content parts": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                    {"type": "text", "text": "wörld"}]}],
    "extra keys": [{"role": "user", "content": "hi", "name": "bob", "meta": {"k": ["é", {"n": 1, "<b>": "&"}]}}],
    "tool call": [SYSTEM, USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "content": '{"temp": 20, "unit": "°C"}', "tool_call_id": "call00001"}, ANSWER],
}


@pytest.fixture(scope="module")
def bpe() -> Any:
    return byte_bpe_tokenizer()


def directory(root: Path, bpe: Any, family: str, template: str | None = None) -> Path:
    """An HF tokenizer directory: the byte-level BPE with the family's special tokens, and its template."""
    from tokenizers import AddedToken, Tokenizer

    bos, eos, specials = FAMILIES[family]
    d = root / family
    d.mkdir(exist_ok=True)
    tok = Tokenizer.from_str(bpe.to_str())
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(d / "tokenizer.json"))
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8") if template is None else template
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": bos, "eos_token": eos,
                                                         "chat_template": template}))
    return d


def assert_renders_as_transformers(d: Path, chat: list[dict[str, Any]], **variables: Any) -> str | None:
    """minillama's rendering of `chat` equals HF's, or both refuse it (minillama in one line); the text."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    try:
        expected = ref.apply_chat_template(chat, tokenize=False, **variables)
    except Exception:  # noqa: BLE001 - the template's own refusal, whatever it raises
        with pytest.raises(TokenizerError, match=r"chat_template: the template failed: [^\n]*$"):
            load_tokenizer(d).apply_chat_template(chat, **variables)
        return None
    assert load_tokenizer(d).apply_chat_template(chat, **variables) == expected
    return expected


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_templates_render_as_transformers(tmp_path, bpe, family):
    d = directory(tmp_path, bpe, family)
    rendered = []
    for chat in CHATS.values():
        for generation in (True, False):
            rendered.append(assert_renders_as_transformers(d, chat, add_generation_prompt=generation))
        rendered.append(assert_renders_as_transformers(d, chat, add_generation_prompt=True, tools=TOOLS))
    rendered.append(assert_renders_as_transformers(d, [USER], add_generation_prompt=True, date_string="1 Jan 2030"))
    rendered.append(assert_renders_as_transformers(d, [USER], add_generation_prompt=True, enable_thinking=False))
    assert sum(r is not None for r in rendered) >= len(rendered) // 3  # a third or more render: it compares text


@pytest.mark.parametrize("family", ["llama-3.1", "qwen-2.5", "mistral-v0.3", "deepseek-r1-distill"])
def test_a_null_field_is_no_field_as_transformers_passes_it(tmp_path, bpe, family):
    """HF leaves out a message's keys whose value is None. An OpenAI client's assistant turn carries
    `"tool_calls": null`: Llama 3.1's template asks `'tool_calls' in message` and failed on it ("object of type
    'NoneType' has no len()"), a chat HF renders; a tool-calling turn's `"content": null` rendered where HF's
    DeepSeek template refuses it."""
    d = directory(tmp_path, bpe, family)
    called = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    result = {"role": "tool", "content": "20", "tool_call_id": "call00001", "name": None}
    for generation in (True, False):
        echoed = assert_renders_as_transformers(d, [USER, {**ANSWER, "tool_calls": None}, AGAIN],
                                                add_generation_prompt=generation)
        assert echoed is not None and "4." in echoed  # rendered, as a plain answer
        assert_renders_as_transformers(d, [USER, called, result], add_generation_prompt=generation)


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_a_messages_reasoning_reaches_the_template_under_each_name_as_transformers_passes_it(tmp_path, bpe, field):
    """HF hands a message's reasoning, given as `reasoning_content`, `thinking` or `reasoning`, to the template
    as both `reasoning_content` (Qwen3's template reads it) and `thinking`: under the other names it was lost."""
    d = directory(tmp_path, bpe, "qwen-3")
    text = assert_renders_as_transformers(d, [USER, {**ANSWER, field: "2 and 2 make 4"}], add_generation_prompt=False)
    assert "<think>\n2 and 2 make 4\n</think>" in text
    assert_renders_as_transformers(d, [USER, {**ANSWER, field: "2 and 2 make 4"}, AGAIN], add_generation_prompt=True)
    reads = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m | tojson }}\n{% endfor %}"
    d = directory(tmp_path, bpe, "smollm2", template=reads)
    chat = [{**ANSWER, field: "why"}, {**ANSWER, "thinking": "a", "reasoning": "b"}, {**ANSWER, "reasoning": "c"}]
    assert "why|why|" in assert_renders_as_transformers(d, chat, add_generation_prompt=False)


def test_continuing_a_message_refuses_a_template_that_drops_an_earlier_one(tmp_path, bpe):
    """Mistral v0.3's template writes the system turn only before a final user turn. Continuing an assistant
    turn (`continued_chat`, the server's continue_final_message) dropped the system text without a word, where
    the same chat not continued is refused (HF renders both without it): now both are refused in one line, and
    the server answers 400 naming messages, as it answers the template's own raise_exception."""
    from transformers import AutoTokenizer

    from minillama.serve.schema import BadRequest, Limits, parse

    d = directory(tmp_path, bpe, "mistral-v0.3")
    tok, ref = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    chat = [SYSTEM, USER, {"role": "assistant", "content": "Bonjour"}]
    for call in (lambda: tok.encode_chat(chat, add_generation_prompt=False), lambda: tok.continued_chat(chat)):
        with pytest.raises(TokenizerError, match=r"message 0's content \(role 'system'\): it would be lost$"):
            call()
    assert tok.continued_chat(chat[1:]) == ref.apply_chat_template(chat[1:], tokenize=False,
                                                                   continue_final_message=True)
    limits = Limits(4096, tok.vocab_size, 16)
    for body, says in (({"messages": chat, "add_generation_prompt": False, "continue_final_message": True},
                        "it would be lost"),
                       ({"messages": [USER, AGAIN]}, "conversation roles must alternate")):
        with pytest.raises(BadRequest, match=rf"^messages: the chat template refused them \(.*{says}") as e:
            parse(body, True, tok, limits, "tiny")
        assert e.value.status == 400 and "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "additional_chat_templates"])
def test_given_tools_the_tool_use_template_renders_as_transformers_picks_it(tmp_path, bpe, where):
    """A checkpoint with named templates (Hermes 2 Pro and Hermes 3, Llama-based, ship "default" and
    "tool_use") renders "tool_use" where tools are given, as HF picks it: minillama rendered "default", a prompt
    without the tools. Saved and loaded again, it still does."""
    from transformers import AutoTokenizer

    default, tool_use = ((TEMPLATES / f"{f}.jinja").read_text(encoding="utf-8") for f in ("smollm2", "qwen-2.5"))
    if where == "tokenizer_config.json":
        d = directory(tmp_path, bpe, "qwen-2.5", [{"name": "default", "template": default},
                                                  {"name": "tool_use", "template": tool_use}])
    else:  # transformers 5's files, which come before tokenizer_config.json's field
        d = directory(tmp_path, bpe, "qwen-2.5", "unused")
        (d / "chat_template.jinja").write_text(default, encoding="utf-8")
        (d / "additional_chat_templates").mkdir()
        (d / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use, encoding="utf-8")
    chat = [SYSTEM, USER]
    assert "get_weather" in assert_renders_as_transformers(d, chat, add_generation_prompt=True, tools=TOOLS)
    assert "get_weather" not in assert_renders_as_transformers(d, chat, add_generation_prompt=True)
    ref = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    assert load_tokenizer(d).encode_chat(chat, tools=TOOLS) == ref.apply_chat_template(
        chat, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    (tmp_path / "again").mkdir()
    load_tokenizer(d).save(tmp_path / "again")
    assert load_tokenizer(tmp_path / "again").apply_chat_template(chat, tools=TOOLS) == \
        ref.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    if where == "tokenizer_config.json":  # a broken one is said when the tokenizer is loaded, naming it
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"][1]["template"] = "{% for m in messages %}"
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (d / "additional_chat_templates" / "tool_use.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match=r"tool_use(\.jinja|\]): not a valid Jinja template \(line 1"):
        load_tokenizer(d)


def test_a_refusal_of_the_tool_use_template_names_its_file(tmp_path, bpe):
    """A message the "tool_use" template does not write was refused naming the default template's file, which
    writes it."""
    d = directory(tmp_path, bpe, "qwen-2.5", "unused")
    (d / "chat_template.jinja").write_text((TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(  # drops the system turn
        "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}")
    tok = load_tokenizer(d)
    tok.encode_chat([SYSTEM, USER])  # the default template writes both
    for call in (lambda: tok.encode_chat([SYSTEM, USER], tools=TOOLS),
                 lambda: tok.continued_chat([SYSTEM, USER, {"role": "assistant", "content": "4"}], tools=TOOLS)):
        with pytest.raises(TokenizerError, match=r"tool_use\.jinja: the template does not write message 0's"):
            call()


def test_an_answer_sent_back_with_its_reasoning_is_refused_saying_what_to_send(tmp_path, bpe):
    """DeepSeek-R1's template writes an earlier answer from its '</think>' on: minillama refuses the cut (the text
    would be lost), and now says what to send instead; the answer without its reasoning renders as HF renders it."""
    d = directory(tmp_path, bpe, "deepseek-r1-distill")
    tok = load_tokenizer(d)
    thought = {"role": "assistant", "content": "2 and 2 make 4.\n</think>\n\nIt is 4."}
    with pytest.raises(TokenizerError, match=r"message 1's content whole \(role 'assistant'\): it cuts it, and the "
                                             r"text given would be lost; send an earlier answer without its reasoning"):
        tok.encode_chat([USER, thought, AGAIN])
    (tmp_path / "cut").mkdir()
    cuts = load_tokenizer(directory(tmp_path / "cut", bpe, "qwen-2.5", "{{ messages[0].content[:5] }}"))
    with pytest.raises(TokenizerError, match=r"would be lost$"):  # no such hint where no reasoning was cut
        cuts.encode_chat([USER])
    assert_renders_as_transformers(d, [USER, {**thought, "content": "It is 4."}, AGAIN], add_generation_prompt=True)

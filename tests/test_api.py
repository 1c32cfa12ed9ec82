"""minillama.api on a tiny random model with a tiny byte-level BPE tokenizer and a ChatML template.

Prompts are built once and tokenized whole; every mode answers the same token ids, and parallel mode gives
each question the bits of its stand-alone run (tokens, log-probs, finish reasons), greedy and sampled.
"""

import pytest
import torch

from minillama import api
from minillama.tokenizer import HFTokenizer
from minillama.tokenizer.base import whole_characters
from minillama.tokenizer.bpe import CHATML, trained_byte_bpe
from tiny import tiny_config, tiny_model

DOC = "The Elm bridge over the river Tay was built in 1932 by the town of Elmford. It is 120 metres long."
QUESTIONS = ["Who built the bridge?", "When was it built?", "How long is it?", "Which river does it cross?"]


def tiny_tokenizer(chat_template: str | None = CHATML) -> HFTokenizer:
    """A byte-level BPE (any UTF-8 text encodes) trained on a few sentences: 300 ids, BOS 1, EOS 2."""
    return trained_byte_bpe([DOC, *QUESTIONS, "Answer the question using the text below."] * 10, 300, chat_template)


def tiny_loaded(chat_template: str | None = CHATML, max_pos: int = 2048) -> api.LoadedModel:
    tok = tiny_tokenizer(chat_template)
    config = tiny_config(vocab=tok.vocab_size, max_pos=max_pos, tied=True)
    return api.LoadedModel(tiny_model(config, seed=1), tok)


@pytest.fixture(scope="module")
def model() -> api.LoadedModel:
    return tiny_loaded()


def test_prompt_ids_tokenize_the_rendered_template_whole(model):
    tok = model.tokenizer
    text = api.prompt_text(tok, DOC, "Who?")
    assert text == ("<|im_start|>user\n" + api.USER_TEMPLATE.format(doc=DOC, question="Who?")
                    + "<|im_end|>\n<|im_start|>assistant\n")
    assert api.prompt_ids(tok, DOC, "Who?") == tok.encode(text)
    with_system = api.prompt_text(tok, DOC, "Who?", system="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert api.messages(DOC, "Who?", "Be brief.")[0] == {"role": "system", "content": "Be brief."}


def test_plain_prompt_without_a_chat_template(model):
    tok = model.tokenizer
    plain = api.PLAIN_TEMPLATE.format(doc=DOC, question="Who?")
    assert api.prompt_text(tok, DOC, "Who?", chat_template=False) == plain
    assert api.prompt_text(tok, DOC, "Who?", system="S", chat_template=False) == "S\n\n" + plain
    assert api.prompt_ids(tok, DOC, "Who?", chat_template=False) == tok.encode(plain, add_special=True)
    no_template = tiny_tokenizer(chat_template=None)
    assert api.prompt_text(no_template, DOC, "Who?") == plain  # falls back by itself


def test_questions_share_the_document_prefix(model):
    prompts = [api.prompt_ids(model.tokenizer, DOC, q) for q in QUESTIONS]
    from minillama.generate import shared_prefix_length

    assert shared_prefix_length(prompts) >= len(model.tokenizer.encode(DOC))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 7}])
def test_parallel_equals_independent(model, sampling):
    par = api.ask(model, DOC, QUESTIONS, max_new_tokens=8, **sampling)
    ind = api.ask(model, DOC, QUESTIONS, max_new_tokens=8, mode="independent", **sampling)
    small_waves = api.ask(model, DOC, QUESTIONS, max_new_tokens=8, parallel_size=3, **sampling)
    for a, b, c in zip(par, ind, small_waves):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == b.logprobs == c.logprobs
        assert a.finish_reason == b.finish_reason == c.finish_reason
        assert a.text == b.text and a.prompt_token_ids == b.prompt_token_ids


def test_reply_fields(model):
    replies = api.ask(model, DOC, QUESTIONS[:2], max_new_tokens=5)
    for qi, r in enumerate(replies):
        assert (r.question, r.doc_index, r.question_index) == (QUESTIONS[qi], 0, qi)
        assert r.prompt_token_ids == api.prompt_ids(model.tokenizer, DOC, QUESTIONS[qi])
        assert len(r.token_ids) == len(r.logprobs) <= 5
        assert all(isinstance(x, float) and x <= 0 for x in r.logprobs)
        assert r.finish_reason in ("stop", "length")
        assert r.text == api.answer_text(model.tokenizer, r.token_ids, {2})


def test_logprobs_are_log_softmax_of_the_raw_logits(model):
    (r,) = api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=4, keep_logits=True)
    for tok, lp, row in zip(r.token_ids, r.logprobs, r.logits):
        assert lp == float(torch.log_softmax(row.float(), dim=-1)[tok])
        assert tok == int(torch.argmax(row))


def test_ask_many_several_documents(model):
    jobs = [(DOC, QUESTIONS[:2]), ("Tay is a river in Scotland.", ["Where is the Tay?"]), (DOC, QUESTIONS[2:])]
    together = api.ask_many(model, jobs, max_new_tokens=6, batch_docs=2)
    assert [len(x) for x in together] == [2, 1, 2]
    for d, (doc, questions) in enumerate(jobs):
        assert [r.doc_index for r in together[d]] == [d] * len(questions)
        assert [r.question for r in together[d]] == list(questions)
    # Greedy answers do not depend on what else is in the pack.
    for d, (doc, questions) in enumerate(jobs):
        alone = api.ask(model, doc, questions, max_new_tokens=6, mode="independent")
        assert [r.token_ids for r in alone] == [r.token_ids for r in together[d]]
        assert [r.logprobs for r in alone] == [r.logprobs for r in together[d]]


def test_stop_string_cuts_the_answer(model):
    (full,) = api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=16, ignore_eos=True)
    assert len(full.text) > 6
    stop = full.text[3:5]
    (cut,) = api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=16, ignore_eos=True, stop=[stop, "\0never"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert stop in model.tokenizer.decode(cut.token_ids)
    before = cut.token_ids[:-1]  # its text without the U+FFFD of a character not yet whole (a stream's)
    assert stop not in whole_characters(model.tokenizer, before[-4:], model.tokenizer.decode(before))


def test_answer_text():
    tok = tiny_tokenizer()
    ids = tok.encode("the town of Elmford<|im_end|>")
    assert api.answer_text(tok, ids, {2}) == "the town of Elmford"
    assert api.answer_text(tok, ids, set()) == "the town of Elmford<|im_end|>"  # ignore_eos: kept, spelled
    assert api.answer_text(tok, ids, {2}, stop=["of", "town"]) == "the "


def test_bad_options_raise_value_error(model):
    for bad in [{"max_new_tokens": -1}, {"temperature": float("nan")}, {"temperature": -0.5},
                {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -3}, {"stop": [""]}, {"mode": "fast"}]:
        with pytest.raises(ValueError):
            api.ask(model, DOC, QUESTIONS[:1], **bad)


def test_prompt_longer_than_the_context_raises():
    small = tiny_loaded(max_pos=128)
    with pytest.raises(api.PromptTooLong, match="question 2: the prompt has .* context is 128"):
        api.ask_many(small, [("short", ["q"]), ("x", ["a", DOC + DOC])], max_new_tokens=2)


def test_questions_must_be_a_list(model):
    with pytest.raises(TypeError):
        api.ask(model, DOC, "Who built the bridge?")


def test_submodules_are_attributes_of_the_package_once_named():
    """The README spells `minillama.generate.SamplingParams`: after `import minillama` alone it raised
    AttributeError (the package's __getattr__ served only the API's names). Run in a fresh interpreter, where
    nothing has imported the submodule yet; importing the package still loads no torch."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys, minillama\n"
             "cheap = 'torch' not in sys.modules\n"
             "p = minillama.generate.SamplingParams(max_new_tokens=3)\n"
             "assert p.max_new_tokens == 3 and minillama.api.ask is minillama.ask\n"
             "assert minillama.tokenizer.Tokenizer and minillama.model.Llama\n"
             "assert not hasattr(minillama, 'no_such_module') and not hasattr(minillama, '__wrapped__')\n"
             "print(cheap)\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr.strip().splitlines()[-1:]


def test_unpacks_as_model_and_tokenizer(model):
    llama, tok = model
    assert llama is model.llama and tok is model.tokenizer
    assert model.context_length == 2048

"""Questions about documents, answered in a few lines: the job `python -m minillama.generate` does.

    model = minillama.api.load()                          # the default model, or load("path/to/ckpt")
    replies = minillama.api.ask(model, doc, ["Who built the bridge?", "When did it open?"])
    replies[0].text, replies[0].token_ids, replies[0].logprobs, replies[0].finish_reason

The prompt of each question is built here, once, by `prompt_ids` (document + question -> chat messages ->
rendered template -> token ids): the CLI, the benchmark and the notebooks all call it. Every question's
prompt is tokenized whole, exactly as a stand-alone run would tokenize it; `generate()` finds the prefix
the questions of one document share (tokenizing the document alone can merge tokens differently
at the boundary; docs/design.md). So the modes differ only in how the same token ids are scheduled.

One loaded model may answer in several threads at once (a threaded web app's): each call gets its own
cache, and each answer the bits of its solo run. While a call is under way, setting
`model.llama.invariant`, `.units` or `.steps.compiled` raises RuntimeError, from any thread or callback.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .checks import SAMPLING_OPTIONS, BadType, check_jobs, check_options, too_long
from .errors import BadInput, check_device
from .generate import SamplingParams, Stats, generate
from .model import Llama
from .options import is_int
from .precision import DTYPES
from .tokenizer import Tokenizer
from .tokens import NEEDS_TOKENIZER

# The user turn: document first, so that the questions of one document share the longest possible
# prefix; instruction and question last. Worded for small instruction-tuned models: SmolLM2-135M
# answers the shipped example (examples/) with it, where "answer the question using the text below"
# before the document made it recite the document's first sentence.
USER_TEMPLATE = "Context: {doc}\n\nUsing only the context above, answer briefly: {question}"
# Without a chat template (base models, --no-chat-template): plain text that ends where the answer starts.
PLAIN_TEMPLATE = "{doc}\n\nQuestion: {question}\nAnswer:"


@dataclass
class LoadedModel:
    """A model and its tokenizer. Unpacks as `llama, tokenizer = minillama.api.load()`."""

    llama: Llama
    tokenizer: Tokenizer

    def __iter__(self) -> Iterator[Any]:
        return iter((self.llama, self.tokenizer))

    @property
    def context_length(self) -> int:
        return self.llama.config.context


@dataclass
class Reply:
    """The answer to one question."""

    question: str
    text: str  # the answer, cut before a stop string; a final EOS / stop token is not spelled out
    token_ids: list[int]  # generated ids, the stop token included
    logprobs: list[float]  # log-softmax of the model's raw logits at each generated token
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_token_ids: list[int]  # the complete stand-alone prompt of this question
    doc_index: int = 0
    question_index: int = 0  # within its document
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # with keep_logits


class PromptTooLong(BadInput):
    """A prompt that does not fit in the model's context (nothing is truncated silently)."""


def load(path: str | Path | None = None, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a checkpoint (an HF directory, a Meta directory or a .gguf file; None: the default model) onto
    `device`, in `dtype` (torch.float32, torch.bfloat16 or torch.float16, or its name)."""
    from .weights import load_model

    if path is not None and not isinstance(path, (str, Path)):
        raise BadType(f"path must be a str or a Path (or None: the default model), got {type(path).__name__}")
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise BadInput(f"dtype must be one of {', '.join(DTYPES)} (a torch dtype or its name), got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise BadType(f"device must be a str or a torch.device, got {type(device).__name__}")
    check_device(str(device), "device")
    llama, tokenizer = load_model(path, device=device, dtype=dtype)
    # a token id past the embedding would fail on the first prompt that holds it: say so now
    tokenizer.check_fits(llama.config.vocab_size)
    return LoadedModel(llama, tokenizer)


def llama_and_tokenizer(model: Any) -> tuple[Llama, Tokenizer] | None:
    """The model and tokenizer of what `ask` takes as its model: what minillama.load returns, or a
    (Llama, Tokenizer) pair; None for anything else."""
    if isinstance(model, LoadedModel):
        return model.llama, model.tokenizer
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], Llama) and isinstance(model[1], Tokenizer):
        return model[0], model[1]
    return None


def messages(doc: str, question: str, system: str | None = None) -> list[dict[str, str]]:
    """The chat of one question: an optional system turn, then one user turn with document and question
    (their surrounding whitespace trimmed: the template places them). With no system turn the
    checkpoint's template adds its own default, if it has one."""
    turns = [{"role": "system", "content": system}] if system is not None else []
    return turns + [{"role": "user", "content": USER_TEMPLATE.format(doc=doc.strip(), question=question.strip())}]


def prompt_text(tokenizer: Tokenizer, doc: str, question: str, system: str | None = None,
                chat_template: bool = True) -> str:
    """The prompt of one question as text: the chat template rendered with a generation prompt, or, when
    the tokenizer has none or `chat_template` is False, `PLAIN_TEMPLATE` after the system text."""
    if chat_template and tokenizer.chat_template is not None:
        return tokenizer.apply_chat_template(messages(doc, question, system), add_generation_prompt=True)
    text = PLAIN_TEMPLATE.format(doc=doc.strip(), question=question.strip())
    return f"{system}\n\n{text}" if system is not None else text


def template_parts(tokenizer: Tokenizer, system: str | None = None, chat_template: bool = True) -> tuple[str, str, str]:
    """The prompt's text before the document, between it and the question, and after the question (the same
    for every prompt): rendered with a private-use mark for each (two the system text does not hold). A chat
    template that does not write both, once each and in order, would lose the user's text: BadInput naming
    the template's field."""
    doc, question = itertools.islice((c for c in map(chr, range(0xE000, 0xF900)) if c not in (system or "")), 2)
    text = prompt_text(tokenizer, doc, question, system, chat_template)
    head, _, rest = text.partition(doc)
    middle, _, tail = rest.partition(question)
    source = getattr(tokenizer, "template_source", "the chat template")
    if not (text.count(doc) == text.count(question) == 1 and head + doc + middle + question + tail == text):
        raise BadInput(f"{source}: the template does not write each message's content as given (the document or "
                       "the question would be lost): mend it, or use --no-chat-template")
    if system is not None and system.strip() not in head:
        raise BadInput(f"{source}: the template does not write the system prompt (it would be lost): leave it out, "
                       "mend the template, or use --no-chat-template")
    return head, middle, tail


def prompt_ids(tokenizer: Tokenizer | LoadedModel, doc: str, question: str, system: str | None = None,
               chat_template: bool = True) -> list[int]:
    """The token ids of one question's complete stand-alone prompt. Document, question and system
    prompt are the user's text: a control token written in them ("<|im_end|>") is spelled out as text;
    only the chat template's own markers are control tokens. Each is checked as `ask` checks it. `tokenizer`
    may also be what `ask` takes as its model (`minillama.load`'s, a (Llama, tokenizer) pair), or a tokenizer
    of one's own (`encode` and `chat_template`, as the benchmark's words)."""
    model = llama_and_tokenizer(tokenizer)
    if model is not None:
        tokenizer = model[1]
    elif not (callable(getattr(tokenizer, "encode", None)) and hasattr(tokenizer, "chat_template")):
        raise BadType(f"tokenizer must be a Tokenizer, what minillama.load returns or a (Llama, tokenizer) pair, "
                      f"got {type(tokenizer).__name__}")
    check_jobs([(doc, [question])])
    check_options(system=system, chat_template=chat_template)
    return _prompt_ids(tokenizer, doc, question, system, chat_template)


def _prompt_ids(tokenizer: Tokenizer, doc: str, question: str, system: str | None, chat_template: bool) -> list[int]:
    if chat_template and tokenizer.chat_template is not None:
        # The template writes BOS itself where the model wants one.
        return tokenizer.encode_chat(messages(doc, question, system), add_generation_prompt=True)
    text = prompt_text(tokenizer, doc, question, system, chat_template)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special=True, parse_special=False)
    return tokenizer.encode(text, add_special=True)  # a tokenizer of one's own, e.g. the benchmark's words


def sampling_params(max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0, ignore_eos: bool = False, stop: str | Sequence[str] = (),
                    tokenizer: Tokenizer | None = None, keep_logits: bool = False) -> SamplingParams:
    """SamplingParams with the stop strings' tokenizer bound. Raises ValueError on a bad value, e.g. a
    negative token count or top_p outside (0, 1], naming the option (the option table, `options.py`)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, ignore_eos=ignore_eos, stop=stop, keep_logits=keep_logits)
    if params.stop_strings and tokenizer is None:
        raise ValueError(NEEDS_TOKENIZER)
    return params.with_tokenizer(tokenizer)


def answer_text(tokenizer: Tokenizer, token_ids: Sequence[int], stop_ids: set[int],
                stop: str | Sequence[str] = (), include_stop: bool = False, skip_special: bool = False) -> str:
    """The text of an answer: a final stop token (EOS, stop id) left out, cut before the first stop string.
    `include_stop` keeps both (the text is cut after the stop string), `skip_special` leaves control tokens
    out (the server's include_stop_str_in_output and skip_special_tokens)."""
    stop = (stop,) if isinstance(stop, str) else stop
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids and not include_stop:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special=skip_special) if skip_special else tokenizer.decode(ids)
    cuts = [(i, -len(s)) for s in stop if (i := text.find(s)) >= 0]
    if not cuts:
        return text
    at, minus_len = min(cuts)
    return text[:at - minus_len if include_stop else at]


def ask(model: LoadedModel, doc: str, questions: Sequence[str], params: SamplingParams | None = None,
        **options: Any) -> list[Reply]:
    """Answer questions about one document; one Reply per question, in order. Options: see `ask_many`."""
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS) - set(ask_many.__kwdefaults__))
    if unknown:  # in ask's name, not ask_many's
        raise TypeError(f"ask() got an unexpected keyword argument {unknown[0]!r}")
    return ask_many(model, [(doc, questions)], params, **options)[0]


def ask_many(model: LoadedModel, jobs: Sequence[tuple[str, Sequence[str]]], params: SamplingParams | None = None,
             *, mode: str = "parallel", system: str | None = None, chat_template: bool = True,
             parallel_size: int | None = None, batch_docs: int | None = None, prefill_chunk: int = 512,
             on_token: Callable[[int], None] | None = None, stats: Stats | None = None,
             on_reply: Callable[[int, Reply], None] | None = None,
             first_question: Sequence[int] | None = None, **sampling: Any) -> list[list[Reply]]:
    """Answer questions about several documents together: jobs are (document, questions) pairs. Returns
    one list of Replies per document. In `parallel` mode each document is prefilled once and all its
    questions decode together; parallel_size caps the questions per document and batch_docs the
    documents per forward pass. Sampling (temperature > 0) draws from one random stream per question,
    seeded from (seed, the question's index over all jobs), so every mode gives the same answers.
    on_reply(i, reply) is called as soon as a reply is finished (in finishing order); i counts the
    questions over all jobs, in job order. first_question[d] (default: the count before job d) numbers job
    d's first question's random stream: a share of a larger run (a data-parallel rank's) keeps its streams.

    How tokens are chosen comes as `params` (a SamplingParams), or as its fields by keyword
    (`max_new_tokens=16, temperature=0.7, stop=["\\n"]`), which replace those of `params` when both are given.
    Every option and input is checked first, as the command line checks them (the option table,
    `options.py`): ValueError (TypeError for a value of the wrong type, such as bytes for a document) names
    the bad one; PromptTooLong when a prompt does not fit in the context, found from the text's length
    where it can be (one pass over the input, not a tokenization of every question's prompt).
    """
    pair = llama_and_tokenizer(model)
    if pair is None:
        raise BadType(f"model must be what minillama.load returns (or a (Llama, tokenizer) pair), got "
                      f"{type(model).__name__}")
    llama, tok = pair
    check_options(mode=mode, system=system, chat_template=chat_template, parallel_size=parallel_size,
                  batch_docs=batch_docs, prefill_chunk=prefill_chunk)
    unknown = sorted(set(sampling) - set(SAMPLING_OPTIONS))
    if unknown:
        raise TypeError(f"ask_many() got an unexpected keyword argument {unknown[0]!r}")
    if params is not None and not isinstance(params, SamplingParams):
        raise BadType(f"params must be a SamplingParams or None, got {type(params).__name__}")
    params = (SamplingParams(**sampling) if params is None else replace(params, **sampling)).with_tokenizer(tok)
    stop = params.stop_strings
    for name, f in (("on_token", on_token), ("on_reply", on_reply)):
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be a function or None")
    jobs = check_jobs(jobs)
    if first_question is not None and (not hasattr(first_question, "__len__") or len(first_question) != len(jobs)
                                       or not all(is_int(k) and k >= 0 for k in first_question)):
        raise ValueError(f"first_question must hold one integer >= 0 for each of the {len(jobs)} documents, "
                         f"got {repr(first_question)[:80]}")
    prompts, docs, where = build_prompts(tok, jobs, system, chat_template, llama.config.context)
    eos = list(dict.fromkeys([*tok.eos_ids, *llama.config.eos_token_ids]))
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))

    def reply(i: int, a: Any) -> Reply:
        d, qi = where[i]
        return Reply(question=jobs[d][1][qi], text=answer_text(tok, a.token_ids, stop_ids, stop),
                     token_ids=a.token_ids, logprobs=a.logprobs, finish_reason=a.finish_reason,
                     prompt_token_ids=list(prompts[i]), doc_index=d, question_index=qi, logits=a.logits)

    answers = generate(llama, prompts, params, mode=mode, docs=docs, parallel_size=parallel_size,
                       batch_docs=batch_docs, eos_ids=eos, prefill_chunk=prefill_chunk, on_token=on_token,
                       stats=stats, on_answer=None if on_reply is None else lambda i, a: on_reply(i, reply(i, a)),
                       streams=None if first_question is None else [int(first_question[d]) + qi for d, qi in where])
    out: list[list[Reply]] = [[] for _ in jobs]
    for i, a in enumerate(answers):
        out[where[i][0]].append(reply(i, a))
    return out


def build_prompts(tokenizer: Tokenizer, jobs: Sequence[tuple[str, Sequence[str]]], system: str | None = None,
                  chat_template: bool = True, context: int | None = None
                  ) -> tuple[list[list[int]], list[int], list[tuple[int, int]]]:
    """Every question's prompt ids, in job order, with its document index and its (document, question)
    position: the three lists `generate()` and the output need. With `context`, a prompt that leaves no
    room to generate one token raises PromptTooLong: first judged from the text's length alone
    (`checks.too_long`), then each prompt as soon as it is tokenized, so a refusal costs about one
    pass over the input."""
    for d, (_, questions) in enumerate(jobs, 1):
        if isinstance(questions, str):
            raise BadType(f"the questions of document {d} must be a list of strings, not one string")
    why = None if context is None else too_long(tokenizer, jobs, context)
    if why is not None:
        raise PromptTooLong(why)
    template_parts(tokenizer, system, chat_template)
    prompts, docs, where = [], [], []
    for d, (doc, questions) in enumerate(jobs):
        for qi, q in enumerate(questions):
            prompts.append(_prompt_ids(tokenizer, doc, q, system, chat_template))  # the jobs were checked
            docs.append(d)
            where.append((d, qi))
            if context is not None:
                check_context(prompts[-1:], where[-1:], context)
    return prompts, docs, where


def check_context(prompts: Sequence[Sequence[int]], where: Sequence[tuple[int, int]], context: int) -> None:
    """Raise PromptTooLong for the first prompt that leaves no room to generate one token."""
    for p, (d, qi) in zip(prompts, where):
        if len(p) >= context:
            raise PromptTooLong(f"document {d + 1}, question {qi + 1}: the prompt has {len(p)} tokens, "
                                f"the model's context is {context}")

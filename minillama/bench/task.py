"""The synthetic task of the parallel-prompting paper: documents of filler text holding facts, questions
about them, prompts; and a word-level stand-in tokenizer for random-weight runs."""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import BadInput

ANIMALS = ["cat", "dog", "horse", "rabbit", "fox", "owl", "goat", "sheep", "duck", "mouse", "tiger", "bear",
           "wolf", "deer", "frog", "lion", "camel", "otter", "eagle", "parrot"]
NAMES = ["Bob", "Alice", "Max", "Luna", "Oscar", "Daisy", "Leo", "Ruby", "Felix", "Rosa", "Hugo", "Nina",
         "Otto", "Ivy", "Jack", "Mia", "Sam", "Lily", "Tom", "Zoe", "Ben", "Ella", "Finn", "Lucy"]
PARTS = ["tail", "nose", "ears", "eyes", "paws", "fur", "neck", "feet", "back", "belly"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "gray"]
# Filler: sentences from a small grammar, with no colors, animals or names in them.
_SUBJECTS = ["The old bridge", "A quiet village", "The morning train", "The river", "A small bakery",
             "The market square", "The library", "An empty road", "The north wind", "The harbour",
             "A wooden fence", "The school bell", "The town clock", "A long meeting", "The garden"]
_VERBS = ["stood still", "was busy", "seemed calm", "grew louder", "stayed open", "was closed",
          "looked different", "was quiet", "felt warm", "was crowded", "moved slowly", "was repaired"]
_TIMES = ["that morning", "in the evening", "after the rain", "during the festival", "before noon",
          "all week", "on Sunday", "in early spring", "late at night", "for a while"]
# Lead-ins that make repeated questions about one fact distinct prompts, and the words that lengthen a
# question to the requested token count.
_LEADS = ["", "Please answer:", "Quick question:", "From the text,", "According to the story,",
          "Tell me,", "In the text,", "One more:"]
_PAD_WORDS = ("Answer with the color only, in one word, as it is written in the text above, and say nothing "
              "else at all about the animal, its name or the rest of the story.").split()


@dataclass(frozen=True)
class TaskConfig:
    doc_tokens: int = 512  # tokens of document text (approximate: whole sentences)
    n_docs: int = 1  # unique documents
    questions_per_doc: int = 64
    question_tokens: int = 0  # at least this many tokens of question text (instruction words appended);
    # 0: the natural question, 11 to 15 tokens with SmolLM2's tokenizer (the paper's ~12)
    new_tokens: int = 8  # answer length: max new tokens, EOS ignored
    seed: int = 0
    numbered: bool = False  # once the lead-ins run out, number the rounds ("Question 2: ..."), so that
    # every question is distinct however many there are; False: the lead-ins go round again


@dataclass
class Task:
    config: TaskConfig
    prompts: list[list[int]]  # one stand-alone prompt per question
    docs: list[int]  # document index of each prompt
    colors: list[str]  # expected answer of each prompt
    doc_texts: list[str]
    questions: list[str]

    @property
    def n(self) -> int:
        return len(self.prompts)


def _facts(rng: random.Random, k: int) -> list[tuple[str, str, str, str]]:
    """k facts (animal, name, part, color); each (animal, name, part) appears once."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    while len(out) < k:
        a, nm, p = rng.choice(ANIMALS), rng.choice(NAMES), rng.choice(PARTS)
        if (a, nm, p) not in seen:
            seen.add((a, nm, p))
            out.append((a, nm, p, rng.choice(COLORS)))
    return out


def _fact_sentence(a: str, nm: str, p: str, c: str) -> str:
    verb = "are" if p.endswith("s") or p == "feet" else "is"
    return f"The {a} named {nm} has {p} that {verb} {c}."


def make_task(tokenizer: Any, config: TaskConfig, prompt_ids: Callable[[str, str], list[int]]) -> Task:
    """Documents, questions and prompts. One fact per ~48 document tokens (at most one per question);
    questions go round the facts, a lead-in distinguishing repeated ones."""
    rng = random.Random(config.seed)
    n_tok = lambda s: len(tokenizer.encode(" " + s))  # noqa: E731
    prompts, docs, colors, texts, questions = [], [], [], [], []
    for d in range(config.n_docs):
        n_facts = max(1, min(config.questions_per_doc, config.doc_tokens // 48))
        facts = _facts(rng, n_facts)
        sentences = [_fact_sentence(*f) for f in facts]
        used = sum(n_tok(s) for s in sentences)
        filler: list[str] = []
        while used < config.doc_tokens:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TIMES)}."
            filler.append(s)
            used += n_tok(s)
        # Facts spread evenly through the filler, at random offsets.
        slots = sorted(rng.sample(range(len(filler) + len(sentences)), len(sentences)))
        body, fi, si = [], 0, 0
        for i in range(len(filler) + len(sentences)):
            if si < len(slots) and slots[si] == i:
                body.append(sentences[si])
                si += 1
            else:
                body.append(filler[fi])
                fi += 1
        text = " ".join(body)
        texts.append(text)
        for q in range(config.questions_per_doc):
            a, nm, p, c = facts[q % n_facts]
            rnd = q // n_facts
            lead = (f"Question {rnd - len(_LEADS) + 2}:" if config.numbered and rnd >= len(_LEADS)
                    else _LEADS[rnd % len(_LEADS)])
            core = f"What color is the {p} of the {a} named {nm}?"
            question = f"{lead} {core}".strip()
            words = 0
            while n_tok(question) < config.question_tokens and words < len(_PAD_WORDS):
                words += 1
                question = f"{lead} {core} {' '.join(_PAD_WORDS[:words])}".strip()
            prompts.append(prompt_ids(text, question))
            docs.append(d)
            colors.append(c)
            questions.append(question)
    return Task(config, prompts, docs, colors, texts, questions)


class WordTokenizer:
    """A stand-in tokenizer for random-weight runs: one id per word or punctuation mark (crc32 hash), so
    token counts look like text and decode gives the words back. No chat template."""

    chat_template = None
    bos_id = None
    eos_ids: list[int] = []

    def __init__(self, vocab_size: int, reserved: int = 3):
        self.vocab = vocab_size
        self.reserved = reserved
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids = []
        for w in re.findall(r"\w+|[^\w\s]|\n", text):
            i = self.reserved + zlib.crc32(w.encode()) % (self.vocab - self.reserved)
            self.words.setdefault(i, w)
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return " ".join(self.words.get(i, f"<{i}>") for i in ids)


def check_fits(task: "Task", new_tokens: int, context: int, what: str) -> None:
    """BadInput naming `what` where the task's longest prompt and its new tokens do not fit the model's
    context: said before a run, not met as a traceback in its first method."""
    longest = max(map(len, task.prompts))
    if longest + new_tokens > context:
        raise BadInput(f"{what}: prompts of up to {longest} tokens and {new_tokens} new ones exceed the model's "
                       f"context ({context})")


def plain_prompt_ids(tokenizer: Any) -> Callable[[str, str], list[int]]:
    """The project's prompt (`api.prompt_ids`): chat template when the tokenizer has one."""
    from ..api import prompt_ids

    return lambda doc, q: prompt_ids(tokenizer, doc, q)

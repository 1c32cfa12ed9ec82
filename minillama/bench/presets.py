"""Presets: which cases make up a run."""

from __future__ import annotations

import dataclasses

from .methods import METHODS, SAMPLED
from .runner import Case
from .task import TaskConfig

ALL = METHODS
SWEEP = ("independent", "independent_plain", "parallel")  # independent: the identity check; plain: the baseline
ONCE = ("independent",)  # in sweeps the reference run is only needed once
MANY_QUESTIONS = (16, 32, 64, 128, 256, 512, 1024)  # the "many" sweep: Table 3's sizes from 128


def preset(name: str, hf: bool, llamacpp: bool = False) -> tuple[list[Case], int]:
    """The cases of a preset and its repeats; `hf` and `llamacpp` say whether those peers are installed.

    quick: a tiny random model, every sweep at two points (CI). default: the paper's configuration with
    the costly methods on a few questions, small sweeps. full: every method on every question in the
    headline (the costly ones once, the others `repeats` times) and the sweeps at the paper's sizes.
    """
    methods = tuple(m for m in ALL if (hf or not m.startswith("hf_")) and (llamacpp or m != "llamacpp"))
    # llama.cpp evaluates the shared document once, as parallel does: it runs in the document-length sweep too.
    doclen = SWEEP + (("llamacpp",) if llamacpp else ())
    # Many questions: independent on a sample (the identity check), parallel and llama.cpp on every one.
    many = ("independent", "parallel") + (("llamacpp",) if llamacpp else ())
    cases: list[Case] = []
    if name == "quick":
        t = TaskConfig(doc_tokens=48, questions_per_doc=6, new_tokens=4)
        cases.append(Case("headline", t, methods, label="paper config, scaled down"))
        for n in (1, 2):
            cases.append(Case("docs", dataclasses.replace(t, n_docs=n, questions_per_doc=4), SWEEP, label=f"docs={n}"))
        for L in (32, 96):
            cases.append(Case("doclen", dataclasses.replace(t, doc_tokens=L), doclen, label=f"doc={L}"))
        for bd, ps in ((1, 2), (2, 4)):
            cases.append(Case("grid", dataclasses.replace(t, n_docs=2, questions_per_doc=4), ("parallel",),
                              parallel_size=ps, batch_docs=bd, label=f"batch={bd} parallel={ps}"))
        for q in (2, 8):
            cases.append(Case("questions", dataclasses.replace(t, questions_per_doc=q), SWEEP, label=f"q={q}"))
        for q in (4, 12):
            cases.append(Case("many", dataclasses.replace(t, questions_per_doc=q, question_tokens=12, new_tokens=3,
                                                           numbered=True),
                              many, sample=2, once=ONCE, label=f"q={q}"))
        return cases, 2
    full = name == "full"
    paper = TaskConfig(doc_tokens=512, questions_per_doc=64, new_tokens=8)
    cases.append(Case("headline", paper, methods, sample=None if full else 4, once=SAMPLED,
                      label="paper config"))
    # The same questions with 16 new tokens: SmolLM2-135M spends its first ~8 tokens restating the question.
    cases.append(Case("answer16", dataclasses.replace(paper, new_tokens=16), ("independent", "parallel"), sample=2,
                      once=ONCE, label="16 new tokens"))
    for n in (1, 2, 4) if not full else (1, 2, 4, 8):  # Fig. 4: unique documents
        cases.append(Case("docs", dataclasses.replace(paper, doc_tokens=256, n_docs=n, questions_per_doc=8 if not full
                                                      else 16), SWEEP, sample=2 * n, once=ONCE, label=f"docs={n}"))
    # Table 4, Figs 5-7: document length, at the paper's 64 questions (the long-document target: 512 -> 4096).
    lengths = (512, 1024, 2048, 4096) if not full else (128, 256, 512, 1024, 2048, 4096)
    for L in lengths:
        cases.append(Case("doclen", dataclasses.replace(paper, doc_tokens=L), doclen,
                          sample=1 if L >= 2048 else 2, once=ONCE, label=f"doc={L}"))
    grid = (((1, 4), (1, 16), (2, 4), (2, 16)) if not full
            else tuple((b, p) for b in (1, 2, 4) for p in (4, 8, 16)))
    for bd, ps in grid:  # Tables 3 and 5: batch size (documents per pass) x parallel size (questions per wave)
        cases.append(Case("grid", dataclasses.replace(paper, doc_tokens=256, n_docs=2 if not full else 4,
                                                      questions_per_doc=16), ("parallel",),
                          parallel_size=ps, batch_docs=bd, label=f"batch={bd} parallel={ps}"))
    for q in (8, 32, 64) if not full else (8, 16, 32, 64, 128):
        cases.append(Case("questions", dataclasses.replace(paper, doc_tokens=256, questions_per_doc=q), SWEEP,
                          sample=2, once=ONCE, label=f"q={q}"))
    # Table 3: one 512-token document, 12-token questions, 5 new tokens, 128 to 1,024 questions; and below
    # it, from 16, the curve of generated tokens per second against questions.
    table3 = TaskConfig(doc_tokens=512, questions_per_doc=128, question_tokens=12, new_tokens=5, numbered=True)
    for q in MANY_QUESTIONS:
        cases.append(Case("many", dataclasses.replace(table3, questions_per_doc=q), many, sample=2, once=ONCE,
                          label=f"q={q}"))
    return cases, (3 if full else 2)

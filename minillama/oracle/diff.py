"""Comparing a candidate with the reference, question by question.

Per question (`compare`): the first step where the greedy tokens part, the largest and mean absolute error of
the logits and log-probabilities, the top-k overlap, and a verdict. Tolerances are elementwise, as
`torch.allclose`: |candidate - reference| <= atol + rtol * |reference|.

Which steps are compared: a candidate run through a backend is teacher-forced (its logits at every step are
computed on the reference's tokens), so every step is. A candidate that generated on its own is compared up
to and including the step where its tokens part from the reference's; after that the two contexts differ.

When may tokens part? Only at a near tie. If the reference prefers token r and the candidate picks c, the
reference's margin logit[r] - logit[c] must be within what the tolerances allow both logits to move,
tol(r) + tol(c). With full logits inside tolerance this always holds; with logprobs only it is the check;
with token ids only, tokens must agree exactly.

`diff_hidden` compares the hidden states two records hold, block by block, with `layers.layer_diff`.
Tolerances and their presets are in tolerances.py, the report a person reads in report.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .backends import Activations, Backend
from .layers import LayerDiff, layer_diff
from .schema import QuestionRecord, Record, RecordError
from .tolerances import Tolerances


@dataclass
class QuestionResult:
    index: int
    steps: int  # reference steps
    candidate_steps: int
    compared: int  # steps whose logits/logprobs were compared
    first_divergence: int | None
    logit_max: float | None = None
    logit_mean: float | None = None
    logprob_max: float | None = None
    logprob_mean: float | None = None
    top_k_overlap: float | None = None  # mean over compared steps of |top-k(ref) & top-k(cand)| / k
    logit_scale: float | None = None  # max |reference logit| over the compared steps
    first_bad_step: int | None = None  # first step whose logits or log-probs leave tolerance
    passed: bool = True
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    layers: LayerDiff | None = None


def _nan_max(xs) -> float:
    """max(), but NaN when one is NaN (max() keeps a NaN only where it comes first)."""
    xs = list(xs)
    return math.nan if any(math.isnan(x) for x in xs) else max(xs)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|, 0 where the two are equal: equal infinities (a masked token's -inf) are no error, as in
    torch.allclose, where their difference would be NaN."""
    return torch.where(a == b, 0.0, (a - b).abs())


def _out_of_tol(err: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    return ~((err == 0) | (err <= atol + rtol * ref.abs()))  # NaN is out; no error is in (0 x inf is NaN)


def compare_question(i: int, ref: QuestionRecord, cand: QuestionRecord, tol: Tolerances,
                     teacher_forced: bool, allow_prefix: bool = False) -> QuestionResult:
    if ref.logits is None:
        raise RecordError("the reference has no logits (export it with minillama.oracle export)")
    if cand.prompt_ids is not None and ref.prompt_ids is not None and cand.prompt_ids != ref.prompt_ids:
        raise RecordError(f"question {i + 1}: the candidate's prompt_ids differ from the reference's")
    R, C = ref.token_ids, cand.token_ids
    vocab = ref.logits.shape[-1]
    bad = next((s for s, t in enumerate(C) if not 0 <= t < vocab), None)
    if bad is not None:
        raise RecordError(f"question {i + 1}: the candidate's token id {C[bad]} at step {bad} is outside the "
                          f"reference's vocabulary (0 .. {vocab - 1})")
    n = min(len(R), len(C))
    div = _first_difference(R, C)
    compared = n if teacher_forced or div is None else div + 1
    res = QuestionResult(i, len(R), len(C), compared, div, notes=list(cand.notes))
    lr = ref.logits[:compared]
    lpr = torch.log_softmax(lr, dim=-1)

    def fail(reason: str, step: int | None = None) -> None:
        if res.passed:
            res.passed, res.reason = False, reason
        if step is not None and (res.first_bad_step is None or step < res.first_bad_step):
            res.first_bad_step = step

    if cand.logits is not None and compared:
        lc = cand.logits[:compared]
        if lc.shape[-1] != lr.shape[-1]:
            raise RecordError(f"question {i + 1}: candidate vocabulary {lc.shape[-1]}, reference {lr.shape[-1]}")
        err = _error(lc, lr)
        res.logit_max, res.logit_mean = float(err.max()), float(err.mean())
        res.logit_scale = float(lr.abs().max())
        bad = _out_of_tol(err, lr, tol.atol, tol.rtol).any(dim=-1).nonzero()
        if len(bad):
            s = int(bad[0])
            fail(f"logits out of tolerance from step {s} (max|err| there {float(err[s].max()):.2e})", s)
        lperr = _error(torch.log_softmax(lc, dim=-1), lpr)
        res.logprob_max, res.logprob_mean = float(lperr.max()), float(lperr.mean())
        bad = _out_of_tol(lperr, lpr, tol.logprob_atol, tol.logprob_rtol).any(dim=-1).nonzero()
        if len(bad):
            fail(f"logprobs out of tolerance from step {int(bad[0])}", int(bad[0]))
        k = min(tol.top_k, lr.shape[-1])
        top_r, top_c = lr.topk(k, dim=-1).indices, lc.topk(k, dim=-1).indices
        overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_r, top_c)]
        res.top_k_overlap = sum(overlap) / len(overlap)
    if cand.logprobs is not None and compared:  # beside logits too: a file's log-probs are its own answer
        want = lpr.gather(1, torch.tensor(C[:compared])[:, None])[:, 0]  # reference logprob of each chosen token
        err = _error(cand.logprobs[:compared], want)
        res.logprob_max = _nan_max([float(err.max())] + ([] if res.logprob_max is None else [res.logprob_max]))
        if res.logprob_mean is None:
            res.logprob_mean = float(err.mean())
        bad = _out_of_tol(err, want, tol.logprob_atol, tol.logprob_rtol).nonzero()
        if len(bad):
            fail(f"logprob of the chosen token out of tolerance from step {int(bad[0])}", int(bad[0]))
        if teacher_forced and cand.top_logprobs is not None:
            _check_top_k(res, lpr, cand, tol, fail)

    if div is not None:
        r, c = R[div], C[div]
        if lr[div, c] > lr[div, r]:  # a parting at a "near tie" of negative margin once passed
            raise RecordError(f"question {i + 1}: the reference's token {r} at step {div} is not the greedy choice "
                              f"of its own logits ({c} scores higher): an edited or mismatched reference")
        if cand.logits is None and cand.logprobs is None:
            fail(f"tokens differ at step {div} ({r} vs {c}) and the candidate gave no logits or logprobs")
        else:
            if cand.logits is not None:
                x, atol, rtol = lr, tol.atol, tol.rtol
            else:
                x, atol, rtol = lpr, tol.logprob_atol, tol.logprob_rtol
            margin = float(x[div, r] - x[div, c])
            allowed = 2 * atol + rtol * float(x[div, r].abs() + x[div, c].abs())
            if margin > allowed:
                fail(f"tokens differ at step {div} ({r} vs {c}): the reference prefers {r} by {margin:.2e}, "
                     f"more than the tolerances allow ({allowed:.2e})")
            else:
                res.notes.append(f"tokens differ at step {div} at a near tie (reference margin {margin:.1e})")
        if not teacher_forced and div + 1 < n:
            res.notes.append(f"steps after {div} not compared: the contexts differ")
    elif len(C) < len(R):
        if allow_prefix:
            res.notes.append(f"the candidate has {len(C)} of the reference's {len(R)} steps (--allow-prefix)")
        else:
            fail(f"the candidate answered {len(C)} of the reference's {len(R)} steps (a shorter answer passes "
                 "only with --allow-prefix)")
    elif len(C) > len(R) and ref.finish_reason == "stop":
        fail(f"the candidate goes on for {len(C) - len(R)} steps after the reference's stop"
             + (f" token {R[-1]}" if R else ", before any token"))
    elif len(C) > len(R):
        res.notes.append(f"the candidate goes on for {len(C) - len(R)} steps after the reference stopped")
    return res


def _check_top_k(res: QuestionResult, lpr: torch.Tensor, cand: QuestionRecord, tol: Tolerances, fail) -> None:
    """A server's top-k at each teacher-forced step: the log-probs of the tokens it names by id, its top-k
    overlap with the reference's, and whether it would pick another token than the reference's."""
    steps = min(len(cand.token_ids), lpr.shape[0])
    ids, lps = cand.top_ids[:steps], cand.top_logprobs[:steps]
    if (ids >= lpr.shape[1]).any():
        raise RecordError(f"question {res.index + 1}: the candidate's top log-probs name token id "
                          f"{int(ids.max())}, outside the vocabulary (0 .. {lpr.shape[1] - 1})")
    odd = (lps.isnan() | (lps == math.inf)).any(dim=-1).nonzero()  # -inf is log 0, and pads a short top-k
    if len(odd):
        fail(f"the server's top-{ids.shape[1]} log-probs hold NaN or +inf from step {int(odd[0])}", int(odd[0]))
    known = ids >= 0
    if known.any():
        want = lpr[:steps].gather(1, ids.clamp(min=0))
        err = torch.where(known, _error(lps, want), torch.zeros(()))
        res.logprob_max = _nan_max([res.logprob_max or 0.0, float(err.max())])
        bad = (_out_of_tol(err, want, tol.logprob_atol, tol.logprob_rtol) & known).any(dim=-1).nonzero()
        if len(bad):
            fail(f"logprobs of the server's top-{ids.shape[1]} out of tolerance from step {int(bad[0])}", int(bad[0]))
    k = ids.shape[1]
    ref_top = lpr[:steps].topk(k, dim=-1).indices
    res.top_k_overlap = sum(len(set(a.tolist()) & set(b[b >= 0].tolist())) / k
                            for a, b in zip(ref_top, ids)) / max(steps, 1)
    unnamed = int((~known & torch.isfinite(lps)).sum())
    if unnamed:
        res.notes.append(f"{unnamed} of the server's top-k tokens have a text no single token has: counted as "
                         "misses in the top-k overlap")
    # The server would pick another token where its best log-prob beats the reference token's.
    for s in range(steps):
        best, own = float(lps[s, 0]), float(cand.logprobs[s])
        if best > own:
            c = int(ids[s, 0])
            name = repr(cand.top_texts[s][0]) if cand.top_texts else "?"
            who = f"{name} (id {c})" if c >= 0 else name
            margin = best - own
            allowed = 2 * tol.logprob_atol + tol.logprob_rtol * (abs(best) + abs(own))
            res.first_divergence = s
            if margin > allowed:
                fail(f"the server prefers {who} to the reference's token {cand.token_ids[s]} at step {s} by "
                     f"{margin:.2e}, more than the tolerances allow ({allowed:.2e})", s)
            else:
                res.notes.append(f"the server prefers {who} at step {s} at a near tie (margin {margin:.1e})")
            break


@dataclass
class Comparison:
    reference: dict[str, Any]
    candidate: dict[str, Any]
    tolerances: Tolerances
    questions: list[QuestionResult]

    @property
    def passed(self) -> bool:
        return all(q.passed for q in self.questions)

    def to_json(self) -> dict[str, Any]:
        return _finite({"passed": self.passed, "reference": self.reference, "candidate": self.candidate,
                        "tolerances": asdict(self.tolerances), "questions": [asdict(q) for q in self.questions],
                        "hints": hints(self)})


def hints(c: Comparison) -> list[str]:
    """Likely causes, read from the pattern of the errors over all questions (sizes measured on the default
    model: fp32 reordering ~1e-6 of the logit scale, an F16 KV cache ~1e-3, Q4_1 weights ~3e-2, a RoPE
    offset or a Q/K permutation ~0.3 and more, with the top-k broken)."""
    qs = [q for q in c.questions if q.compared]
    if not qs:
        return []
    overlap = min((q.top_k_overlap for q in qs if q.top_k_overlap is not None), default=None)
    steps0 = all(q.first_bad_step in (None, 0) for q in qs) and any(q.first_bad_step == 0 for q in qs)
    from_start = " from the first step on" if steps0 else ""
    with_logits = [q for q in qs if q.logit_max is not None]
    if with_logits:
        err = _nan_max(q.logit_max for q in with_logits)
        scale = max(q.logit_scale or 1.0 for q in with_logits)
        lp = _nan_max(q.logprob_max or 0.0 for q in with_logits)
        rel = err / scale
        size = f"max|dlogit| {err:.1e} = {rel:.0e} of the logit scale ({scale:.0f})"
        if math.isfinite(rel) and not math.isfinite(lp):  # the file's own log-probs, beside finite logits
            rel, size = lp, f"max|dlogprob| {lp:.1e}"
        if err > 1e-3 and lp < 0.01 * err:
            return [f"{size}, but the log-probs agree ({lp:.1e}): the logits are shifted by a constant per step "
                    "(another normalization of the logits); sampling is unaffected"]
        bands = (1e-5, 3e-3, 0.1)
    else:
        rel = _nan_max(q.logprob_max or 0.0 for q in qs)
        size = f"max|dlogprob| {rel:.1e}"
        bands = (1e-4, 0.1, 2.0)
    if not math.isfinite(rel):  # every comparison below is False for NaN: it once read as quantization
        return [f"{size}: the candidate gives NaN or inf values, a numerical fault (an overflow in half precision, "
                "a buffer never written), not rounding: no preset accepts it"]
    if rel <= bands[0]:
        return []
    if overlap is not None and overlap < 0.8 or rel > bands[2]:
        top = f", top-k overlap {overlap:.2f}" if overlap is not None else ""
        return [f"{size}{top}: too large for rounding, a bug. Most often a RoPE position offset (positions that "
                "do not continue the prompt's), Q/K rows in interleaved (Meta, GGUF) order where rotate-half (HF) "
                "order is expected or the reverse, or another rope_theta. `--layers` (transformers backend) or "
                "`export --hidden` names the layer and sub-module"]
    if rel <= bands[1]:
        return [f"{size}{from_start}, top-k intact: the size of half-precision rounding. Most often a KV cache "
                "in F16 or BF16 (llama.cpp's is F16 unless told: --cache-type-k f32 --cache-type-v f32, "
                "type_k/type_v in llama-cpp-python) or half-precision activations; `--preset half` accepts it"]
    return [f"{size}{from_start}: the size of quantized weights (Q8_0, Q4) and of activations quantized to "
            "match them, as llama.cpp does; `--preset quantized` accepts it"]


def _finite(x: Any) -> Any:
    """NaN and infinities as strings: JSON has no numbers for them."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def compare(ref: Record, cand: Record, tol: Tolerances | None = None,
            allow_prefix: bool = False) -> list[QuestionResult]:
    """Every question of `cand` against `ref`. A candidate answer shorter than the reference's fails unless
    `allow_prefix` (then it passes on the steps it has, with a note)."""
    tol = tol or Tolerances()
    if len(cand.questions) != len(ref.questions):
        raise RecordError(f"the candidate has {len(cand.questions)} questions, the reference {len(ref.questions)}")
    return [compare_question(i, r, c, tol, cand.teacher_forced, allow_prefix)
            for i, (r, c) in enumerate(zip(ref.questions, cand.questions))]


def _hidden_activations(q: QuestionRecord, upto: int) -> Activations:
    """A record's hidden states as activations ("embed", "layers.{i}"), for a block-level layer diff."""
    h = q.hidden[:, :upto]
    return Activations({"embed": h[0], **{f"layers.{i}": h[i + 1] for i in range(h.shape[0] - 1)}})


# --------------------------------------------------------------------------------------------------
# Running a backend on the reference's tokens


def run_backend(ref: Record, backend: Backend) -> Record:
    """The candidate at every step of every reference answer, teacher-forced (`Backend.teacher_force`): its
    logits (or a server's log-probs) on the reference's prompt and answer."""
    _check_vocabulary(ref, backend)
    out = []
    for i, q in enumerate(ref.questions):
        if q.prompt_ids is None:
            raise RecordError(f"question {i + 1}: the reference has no prompt_ids to run the backend on")
        q.check(f"question {i + 1}")  # an empty prompt has no last row to be step 0's logits (row -1)
        out.append(backend.teacher_force(q.prompt_ids, q.token_ids))
    return Record(out, {"describe": f"{backend.describe()}, teacher-forced on the reference's tokens"},
                  teacher_forced=True)


def _check_vocabulary(ref: Record, backend: Backend) -> None:
    """The backend's vocabulary is the reference's, before it runs: a token id past its end makes a backend fail
    in its own way (an IndexError, llama.cpp's decode error), and a larger one may pick an id the reference
    has no logit for."""
    size = backend.vocab_size()
    if size is None:
        return
    ids = [t for q in ref.questions for t in (q.prompt_ids or []) + q.token_ids]
    if ids and max(ids) >= size:
        raise RecordError(f"the reference's token ids reach {max(ids)}; the backend's vocabulary has {size} tokens")
    width = next((q.logits.shape[-1] for q in ref.questions if q.logits is not None), None)
    if width is not None and width != size:
        raise RecordError(f"the reference's vocabulary has {width} tokens (its logits), the backend's {size}: "
                          "not one model's")


def diff_hidden(ref: Record, cand: Record, tol: Tolerances) -> list[LayerDiff | None]:
    """Block-level layer diff from the hidden states two records hold (None where one has none), over the
    tokens both runs share: the prompt and the answers' common prefix."""
    out: list[LayerDiff | None] = []
    for r, c in zip(ref.questions, cand.questions):
        if r.hidden is None or c.hidden is None or r.prompt_ids is None:
            out.append(None)
            continue
        if (r.hidden.shape[0], r.hidden.shape[2]) != (c.hidden.shape[0], c.hidden.shape[2]):  # not a part of them
            raise RecordError(f"question {len(out) + 1}: the reference holds hidden states of {r.hidden.shape[0]} "
                              f"blocks (embeddings and layers) of width {r.hidden.shape[2]}, the candidate "
                              f"{c.hidden.shape[0]} of width {c.hidden.shape[2]}")
        same = _first_difference(r.token_ids, c.token_ids)
        if same is None:
            same = min(len(r.token_ids), len(c.token_ids))
        # Hidden row P + s holds answer token s: the same in both below `same`; each record holds rows up to
        # its own answer's last token but one, so where one answer is the other's start, the shorter's rows.
        rows = min(len(r.prompt_ids) + same, r.hidden.shape[1], c.hidden.shape[1])
        out.append(layer_diff(_hidden_activations(r, rows), _hidden_activations(c, rows), tol))
    return out

"""Comparing a candidate with the reference: per question, and layer by layer.

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

Layer by layer (`layer_diff`): both backends run the same token ids; every activation (backends.py names
them) is compared in forward order, and the first whose max |error| exceeds `layer_rtol * max |reference|`
is named, with its layer, its kind (embedding, norm, attention, RoPE, MLP, residual, lm_head) and the first
token where it leaves tolerance. The error is scaled by the activation's own magnitude because the residual
stream of a real model holds features of 10^4 next to features of 10^-2 (the fp32 noise between minillama
and HF transformers stays near 4e-6 of each activation's scale on the default model).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .backends import Activations, Backend, activation_names, kind_of, layer_of
from .record import QuestionRecord, Record, RecordError


@dataclass
class Tolerances:
    atol: float = 1e-4  # logits
    rtol: float = 1e-4
    logprob_atol: float = 1e-4
    logprob_rtol: float = 1e-4
    layer_rtol: float = 1e-4  # activations: max |err| <= layer_rtol * max |reference|
    top_k: int = 5
    preset: str | None = None  # the preset these came from, "+" when some were changed

    def describe(self) -> str:
        head = f"preset {self.preset}: " if self.preset else ""
        return (f"{head}logits |err| <= {self.atol:g} + {self.rtol:g}*|ref|; logprobs |err| <= {self.logprob_atol:g} "
                f"+ {self.logprob_rtol:g}*|ref|; activations max|err| <= {self.layer_rtol:g} * max|ref|")


# Tolerances by what the candidate is. Logit and log-prob tolerances go together: a log-prob is a logit minus
# the row's log-sum-exp, so it moves by up to about twice what the logits move.
#   exact      minillama against minillama (another mode, a saved run on the same machine): the same bits
#   fp32       an fp32 implementation of the same arithmetic in another order (HF transformers: ~6e-5 on
#              logits of ~40 on the default model)
#   half       F16/BF16 somewhere (a half-precision KV cache: ~3e-2 on the default model's logits)
#   quantized  quantized weights and activations (llama.cpp on the Q4_1 file: up to ~1.3)
PRESETS: dict[str, Tolerances] = {
    "exact": Tolerances(0.0, 0.0, 0.0, 0.0, 0.0, preset="exact"),
    "fp32": Tolerances(1e-4, 1e-4, 1e-4, 1e-4, 1e-4, preset="fp32"),
    "half": Tolerances(0.1, 0.0, 0.1, 0.0, 1e-2, preset="half"),
    "quantized": Tolerances(1.5, 0.0, 1.5, 0.0, 0.1, preset="quantized"),
}
# The preset each backend gets unless told otherwise; candidate files get fp32 ("exact" if minillama made them).
BACKEND_PRESETS = {"minillama": "exact", "transformers": "fp32", "llama-cpp": "quantized", "openai": "fp32"}


# --------------------------------------------------------------------------------------------------
# Layer diff


@dataclass
class LayerRow:
    name: str
    kind: str
    layer: int | None
    max_err: float
    scale: float  # max |reference|
    rel: float  # max_err / scale
    worst_token: int
    first_bad_token: int | None  # first token out of tolerance, None if within


@dataclass
class LayerDiff:
    tokens: int
    rows: list[LayerRow]
    first_bad: LayerRow | None
    hint: str | None = None

    @property
    def worst(self) -> LayerRow:
        return max(self.rows, key=lambda r: r.rel)

    def summary(self) -> str:
        b = self.first_bad
        if b is None:
            w = self.worst
            return f"every activation within tolerance (largest: {w.rel:.1e} of scale at {w.name})"
        where = f"layer {b.layer} {b.kind}" if b.layer is not None else b.kind
        return (f"first out of tolerance: {where} ({b.name}), from token {b.first_bad_token}: "
                f"max|err| {b.max_err:.2e} = {b.rel:.1e} of scale")


def layer_diff(ref: Activations, cand: Activations, tol: Tolerances) -> LayerDiff:
    """Compare two runs on the same tokens, activation by activation, in forward order."""
    n_layers = 1 + max((layer_of(k) for k in ref.tensors if layer_of(k) is not None), default=-1)
    rows: list[LayerRow] = []
    first_bad = None
    tokens = next(iter(ref.tensors.values())).shape[0]
    for name in activation_names(n_layers):
        r, c = ref.tensors.get(name), cand.tensors.get(name)
        if r is None or c is None:
            continue
        if r.shape != c.shape:
            raise RecordError(f"activation {name}: reference shape {tuple(r.shape)}, candidate {tuple(c.shape)}")
        err = (c - r).abs().reshape(r.shape[0], -1)
        per_token = err.max(dim=1).values  # (T,)
        scale = float(r.abs().max()) or 1.0
        bad = (~(per_token <= tol.layer_rtol * scale)).nonzero()  # NaN is out of tolerance
        max_err = float(per_token.max())
        row = LayerRow(name, kind_of(name), layer_of(name), max_err, scale, max_err / scale,
                       int(per_token.argmax()), int(bad[0]) if len(bad) else None)
        rows.append(row)
        if first_bad is None and row.first_bad_token is not None:
            first_bad = row
    diff = LayerDiff(tokens, rows, first_bad)
    if first_bad is not None:
        diff.hint = _hint(first_bad, ref, cand, tol)
    return diff


def _hint(bad: LayerRow, ref: Activations, cand: Activations, tol: Tolerances) -> str | None:
    """A likely cause for the two classic porting bugs: Q/K row order and the rotation itself."""
    if bad.kind == "RoPE" and ref.cos is not None and cand.cos is not None:
        return _rope_hint(bad.first_bad_token, ref, cand)
    if bad.name.endswith(("q_proj", "k_proj")) and ref.cos is not None:
        d = ref.cos.shape[-1]
        r, c = ref.tensors[bad.name], cand.tensors[bad.name]
        heads = r.shape[1] // d
        rs = r.view(r.shape[0], heads, d).sort(dim=-1).values
        cs = c.view(c.shape[0], heads, d).sort(dim=-1).values
        if float((rs - cs).abs().max()) <= tol.layer_rtol * bad.scale:
            return ("the same values in another order within each head: Q/K rows are in interleaved RoPE order "
                    "(Meta, GGUF) where rotate-half order (HF) is expected, or the other way round; "
                    "permute the Q and K weights (minillama.weights.interleaved_to_half)")
    return None


def _rope_hint(token: int, ref: Activations, cand: Activations) -> str:
    # Which reference position rotates like the candidate's token? Search the reference's own table.
    table = torch.cat([ref.cos, ref.sin], dim=-1)  # (T, 2D)
    row = torch.cat([cand.cos[token], cand.sin[token]])
    err = (table - row).abs().max(dim=-1).values
    match = int(err.argmin())
    if float(err[match]) < 1e-5 and match != token:
        return (f"token {token} is rotated as the reference rotates token {match}: its position is off by "
                f"{match - token:+d} (position ids, or a segment's start offset)")
    # Otherwise the frequencies differ. At position 1 the angle of pair j is inv_freq[j] = theta^(-2j/D);
    # pair 1 gives theta back.
    d = ref.cos.shape[-1]
    if ref.cos.shape[0] > 1:
        thetas = []
        for c in (ref, cand):
            angle = float(torch.atan2(c.sin[1, 1], c.cos[1, 1]))
            thetas.append(angle ** (-d / 2) if angle > 0 else float("nan"))
        return (f"rotation angles differ from token {token} on and match no reference position: the frequencies "
                f"differ (rope_theta, rope_scaling or head_dim); the angles fit rope_theta ~ {thetas[1]:.4g} "
                f"against the reference's {thetas[0]:.4g} (if token 1 sits at position 1)")
    return "rotation angles differ: rope_theta, rope_scaling or positions"


# --------------------------------------------------------------------------------------------------
# Per-question comparison


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


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _out_of_tol(err: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    return ~(err <= atol + rtol * ref.abs())  # written so that NaN is out of tolerance


def compare_question(i: int, ref: QuestionRecord, cand: QuestionRecord, tol: Tolerances,
                     teacher_forced: bool, allow_prefix: bool = False) -> QuestionResult:
    if ref.logits is None:
        raise RecordError("the reference has no logits (export it with minillama.oracle export)")
    if cand.prompt_ids is not None and ref.prompt_ids is not None and cand.prompt_ids != ref.prompt_ids:
        raise RecordError(f"question {i + 1}: the candidate's prompt_ids differ from the reference's")
    R, C = ref.token_ids, cand.token_ids
    vocab = ref.logits.shape[-1]
    if any(not 0 <= t < vocab for t in C):
        raise RecordError(f"question {i + 1}: candidate token ids must be in 0 .. {vocab - 1}")
    n = min(len(R), len(C))
    div = _first_difference(R, C)
    compared = n if teacher_forced or div is None else div + 1
    res = QuestionResult(i, len(R), len(C), compared, div)
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
        err = (lc - lr).abs()
        res.logit_max, res.logit_mean = float(err.max()), float(err.mean())
        res.logit_scale = float(lr.abs().max())
        bad = _out_of_tol(err, lr, tol.atol, tol.rtol).any(dim=-1).nonzero()
        if len(bad):
            s = int(bad[0])
            fail(f"logits out of tolerance from step {s} (max|err| there {float(err[s].max()):.2e})", s)
        lperr = (torch.log_softmax(lc, dim=-1) - lpr).abs()
        res.logprob_max, res.logprob_mean = float(lperr.max()), float(lperr.mean())
        bad = _out_of_tol(lperr, lpr, tol.logprob_atol, tol.logprob_rtol).any(dim=-1).nonzero()
        if len(bad):
            fail(f"logprobs out of tolerance from step {int(bad[0])}", int(bad[0]))
        k = min(tol.top_k, lr.shape[-1])
        top_r, top_c = lr.topk(k, dim=-1).indices, lc.topk(k, dim=-1).indices
        overlap = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_r, top_c)]
        res.top_k_overlap = sum(overlap) / len(overlap)
    elif cand.logprobs is not None and compared:
        want = lpr.gather(1, torch.tensor(C[:compared])[:, None])[:, 0]  # reference logprob of each chosen token
        err = (cand.logprobs[:compared] - want).abs()
        res.logprob_max, res.logprob_mean = float(err.max()), float(err.mean())
        bad = _out_of_tol(err, want, tol.logprob_atol, tol.logprob_rtol).nonzero()
        if len(bad):
            fail(f"logprob of the chosen token out of tolerance from step {int(bad[0])}", int(bad[0]))
        if teacher_forced and cand.top_logprobs is not None:
            _check_top_k(res, lpr, cand, tol, fail)

    if div is not None:
        r, c = R[div], C[div]
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
    elif len(C) > len(R):
        res.notes.append(f"the candidate goes on for {len(C) - len(R)} steps after the reference stopped")
    return res


def _check_top_k(res: QuestionResult, lpr: torch.Tensor, cand: QuestionRecord, tol: Tolerances, fail) -> None:
    """A server's top-k at each teacher-forced step: the log-probs of the tokens it names by id, its top-k
    overlap with the reference's, and whether it would pick another token than the reference's."""
    steps = min(len(cand.token_ids), lpr.shape[0])
    ids, lps = cand.top_ids[:steps], cand.top_logprobs[:steps]
    known = ids >= 0
    if known.any():
        want = lpr[:steps].gather(1, ids.clamp(min=0))
        err = torch.where(known & torch.isfinite(lps), (lps - want).abs(), torch.zeros(()))
        res.logprob_max = max(res.logprob_max or 0.0, float(err.max()))
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
        err = max(q.logit_max for q in with_logits)
        scale = max(q.logit_scale or 1.0 for q in with_logits)
        lp = max(q.logprob_max or 0.0 for q in with_logits)
        rel = err / scale
        size = f"max|dlogit| {err:.1e} = {rel:.0e} of the logit scale ({scale:.0f})"
        if err > 1e-3 and lp < 0.01 * err:
            return [f"{size}, but the log-probs agree ({lp:.1e}): the logits are shifted by a constant per step "
                    "(another normalization of the logits); sampling is unaffected"]
        bands = (1e-5, 3e-3, 0.1)
    else:
        rel = max(q.logprob_max or 0.0 for q in qs)
        size = f"max|dlogprob| {rel:.1e}"
        bands = (1e-4, 0.1, 2.0)
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
    out = []
    for i, q in enumerate(ref.questions):
        if q.prompt_ids is None:
            raise RecordError(f"question {i + 1}: the reference has no prompt_ids to run the backend on")
        out.append(backend.teacher_force(q.prompt_ids, q.token_ids))
    return Record(out, {"describe": f"{backend.describe()}, teacher-forced on the reference's tokens"},
                  teacher_forced=True)


def diff_layers(ref: Record, reference: Backend, candidate: Backend, tol: Tolerances) -> list[LayerDiff]:
    """Layer diff of every question, on its prompt and the reference's answer."""
    out = []
    for q in ref.questions:
        ids = q.prompt_ids + q.token_ids[:-1]
        out.append(layer_diff(reference.activations(ids), candidate.activations(ids), tol))
    return out


def diff_hidden(ref: Record, cand: Record, tol: Tolerances) -> list[LayerDiff | None]:
    """Block-level layer diff from the hidden states two records hold (None where one has none), over the
    tokens both runs share: the prompt and the answers' common prefix."""
    out: list[LayerDiff | None] = []
    for r, c in zip(ref.questions, cand.questions):
        if r.hidden is None or c.hidden is None or r.prompt_ids is None:
            out.append(None)
            continue
        same = _first_difference(r.token_ids, c.token_ids)
        if same is None:
            same = min(len(r.token_ids), len(c.token_ids))
        rows = len(r.prompt_ids) + same  # hidden row P + s holds answer token s: the same in both below `same`
        out.append(layer_diff(_hidden_activations(r, rows), _hidden_activations(c, rows), tol))
    return out


# --------------------------------------------------------------------------------------------------
# The report


def _fmt(x: float | None, spec: str = ".1e") -> str:
    return "-" if x is None else format(x, spec)


def report(c: Comparison) -> str:
    tol = c.tolerances
    lines = [f"reference  {c.reference.get('describe', '')}",
             f"candidate  {c.candidate.get('describe', '')}",
             f"tolerance  {tol.describe()}", ""]
    head = (f"{'q':>3}  {'steps':>5}  {'diverges':>8}  {'max|dlogit|':>11}  {'mean|dlogit|':>12}  "
            f"{'max|dlogprob|':>13}  {'top-' + str(tol.top_k):>5}  verdict")
    lines.append(head)
    for q in c.questions:
        steps = f"{q.compared}" if q.compared == q.steps else f"{q.compared}/{q.steps}"
        div = "-" if q.first_divergence is None else f"step {q.first_divergence}"
        verdict = "pass" if q.passed else f"FAIL: {q.reason}"
        lines.append(f"{q.index + 1:>3}  {steps:>5}  {div:>8}  {_fmt(q.logit_max):>11}  {_fmt(q.logit_mean):>12}  "
                     f"{_fmt(q.logprob_max):>13}  {_fmt(q.top_k_overlap, '.2f'):>5}  {verdict}")
        for note in q.notes:
            lines.append(f"{'':>5}note: {note}")
    for q in c.questions:
        if q.layers is not None:
            lines += ["", f"layer diff, question {q.index + 1} ({q.layers.tokens} tokens): {q.layers.summary()}"]
            if q.layers.hint:
                lines.append(f"  hint: {q.layers.hint}")
    with_layers = [q for q in c.questions if q.layers is not None]
    shown = next((q for q in with_layers if q.layers.first_bad is not None), with_layers[0] if with_layers else None)
    if shown is not None:
        lines += ["", f"layer table, question {shown.index + 1}:", layer_table(shown.layers)]
    for h in hints(c):
        lines += ["", f"hint: {h}"]
    n_pass = sum(q.passed for q in c.questions)
    lines += ["", f"{n_pass} of {len(c.questions)} questions pass: {'PASS' if c.passed else 'FAIL'}"]
    return "\n".join(lines)


_COLUMNS = [("in_norm", ["input_layernorm"]), ("q/k/v", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            ("rope", ["self_attn.q_rope", "self_attn.k_rope"]), ("attn", ["self_attn"]),
            ("post_norm", ["post_attention_layernorm"]), ("mlp", ["mlp"]), ("out", [])]  # []: the block output


def layer_table(d: LayerDiff) -> str:
    """One line per layer: max |err| / max |ref| of each sub-module; `<` marks the first out of tolerance."""
    by_name = {r.name: r for r in d.rows}
    bad = d.first_bad.name if d.first_bad else None

    def cell(names: list[str]) -> str:
        rows = [by_name[n] for n in names if n in by_name]
        if not rows:
            return f"{'':>9}"
        mark = "<" if any(r.name == bad for r in rows) else " "
        return f"{max(r.rel for r in rows):>8.1e}{mark}"

    lines = ["  relative error per sub-module (max|err| / max|ref|), '<' first out of tolerance",
             f"  {'layer':>5}  " + " ".join(f"{name:>9}" for name, _ in _COLUMNS)]
    lines.append(f"  {'embed':>5}  {cell(['embed'])}")
    layers = sorted({r.layer for r in d.rows if r.layer is not None})
    for i in layers:
        names = [[f"layers.{i}.{s}" for s in subs] or [f"layers.{i}"] for _, subs in _COLUMNS]
        lines.append(f"  {i:>5}  " + " ".join(cell(n) for n in names))
    tail = [n for n in ("norm", "logits") if n in by_name]
    if tail:
        lines.append(f"  {'final':>5}  " + "  ".join(f"{n} {cell([n]).strip()}" for n in tail))
    return "\n".join(lines)

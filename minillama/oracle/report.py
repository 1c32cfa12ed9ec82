"""The comparison as a person reads it: one line per question, notes, the layer diff and its table, hints.
"""

from __future__ import annotations

from .diff import Comparison, hints
from .layers import LayerDiff


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

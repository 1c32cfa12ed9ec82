"""Layer by layer: where two runs on the same tokens first part, activation by activation.

Both backends run the same token ids; every activation (backends.py names them) is compared in forward
order, and the first whose max |error| exceeds `layer_rtol * max |reference|` is named, with its layer, its
kind (embedding, norm, attention, RoPE, MLP, residual, lm_head) and the first token where it leaves
tolerance. The error is scaled by the activation's own magnitude because the residual stream of a real model
holds features of 10^4 next to features of 10^-2 (the fp32 noise between minillama and HF transformers stays
near 4e-6 of each activation's scale on the default model). For the two classic porting bugs (Q/K row order,
the rotation itself) a hint names the likely cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import Activations, Backend, activation_names, kind_of, layer_of
from .schema import Record, RecordError
from .tolerances import Tolerances


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


def diff_layers(ref: Record, reference: Backend, candidate: Backend, tol: Tolerances) -> list[LayerDiff]:
    """Layer diff of every question, on its prompt and the reference's answer."""
    out = []
    for q in ref.questions:
        ids = q.prompt_ids + q.token_ids[:-1]
        out.append(layer_diff(reference.activations(ids), candidate.activations(ids), tol))
    return out

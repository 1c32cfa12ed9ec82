"""A request's own change to its row of logits before its token is picked: `allowed_token_ids` and `min_p`.

Each filter is a function of one (vocab,) row alone, so a sequence's tokens still do not depend on what
else is in the forward pass. They run where vLLM runs them: `allowed_token_ids` first (every other token
gets -inf), then `min_p` on the temperature-scaled distribution (a token less likely than `min_p` times
the likeliest one is dropped; a no-op for greedy decoding, which takes the likeliest anyway), then
`generate.sample`'s own top-k and top-p. The log-probs a response reports stay the model's: those of the
raw row, as for every other request (the engine puts them back after the pick).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

RowFilter = Callable[[torch.Tensor], torch.Tensor]


def row_filter(vocab: int, temperature: float, min_p: float = 0.0,
               allowed: Sequence[int] | None = None) -> RowFilter | None:
    """The filter of one request's rows, or None when it asks for none."""
    use_min_p = min_p > 0 and temperature > 0
    if not use_min_p and allowed is None:
        return None
    dropped = None
    if allowed is not None:
        dropped = torch.ones(vocab, dtype=torch.bool)
        dropped[torch.tensor(sorted(set(allowed)), dtype=torch.long)] = False
    on_device: dict[torch.device, torch.Tensor] = {}  # `dropped` on each device it was used on: moved once

    def apply(row: torch.Tensor) -> torch.Tensor:  # row: (vocab,)
        x = row
        if dropped is not None:
            if x.device not in on_device:
                on_device[x.device] = dropped.to(x.device)
            x = x.masked_fill(on_device[x.device], float("-inf"))
        if use_min_p:
            # p_i / p_max = exp((x_i - x_max) / T), in float64 so that a tiny temperature cannot overflow.
            z = (x.double() - x.double().max()) / temperature
            x = x.masked_fill(z < math.log(min_p), float("-inf"))
        return x

    return apply


def filtered(filters: Sequence[RowFilter | None], raw: torch.Tensor) -> torch.Tensor:
    """The rows tokens are picked from: row i through filters[i] (a request's min_p or allowed_token_ids),
    rows without one as they are. raw: (Q, vocab)."""
    if not any(filters):
        return raw
    rows = raw.clone()
    for i, f in enumerate(filters):
        if f is not None:
            rows[i] = f(raw[i])
    return rows


# A prompt token's (log-prob, rank, top-k (token id, log-prob) pairs); (None, None, []) for the first.
PromptLogprob = tuple[float | None, int | None, list[tuple[int, float]]]


def prompt_row_entries(rows: torch.Tensor, prompt: Sequence[int], first: int, top_k: int) -> list[PromptLogprob]:
    """Echo / prompt_logprobs of the prompt's rows first, first + 1, ... (rows: their log-softmax, (R, vocab)):
    row t gives prompt token t + 1's log-prob given the tokens before it, its rank there (1: the likeliest)
    and the top-k at its position; the prompt's last row (it predicts the answer) gives none. Each row on its
    own, so a server reduces each pass's rows as they come rather than holding a vocabulary of floats per
    prompt token (the first token's entry, (None, None, []), is the caller's)."""
    rows = rows[:max(0, len(prompt) - 1 - first)]
    nxt = torch.tensor(prompt[first + 1:first + 1 + len(rows)], dtype=torch.long, device=rows.device)
    picked = rows.gather(1, nxt[:, None])  # (R, 1)
    chosen = picked[:, 0].tolist()
    ranks = ((rows > picked).sum(dim=1) + 1).tolist()
    tops = top_entries(rows, top_k) if top_k and len(nxt) else [[] for _ in chosen]
    return list(zip(chosen, ranks, tops))


def top_entries(lp: torch.Tensor, k: int, chunk: int = 64) -> list[list[tuple[int, float]]]:
    """Each row's k likeliest (token id, log-prob), likeliest first, tied log-probs in token id order. lp: (R,
    vocab). `torch.topk` picks and orders tied values by the k it is asked for (bfloat16 ties often), so a
    request's top log-probs would follow another request's k in the same pass; here `topk` gives the values
    (the same whichever tied id it picks) and the ids where no tie crosses the k-th place, and the rule above
    the order, and the ids where a tie does."""
    k = min(k, lp.shape[-1])
    if k <= 0:
        return [[] for _ in range(lp.shape[0])]
    out: list[list[tuple[int, float]]] = []
    for a in range(0, lp.shape[0], chunk):
        x = lp[a:a + chunk]
        vals, ids = x.topk(k, dim=-1)
        if vals.isnan().any():  # topk takes NaN for the largest: a NaN is the least likely here
            x = x.masked_fill(x.isnan(), float("-inf"))
            vals, ids = x.topk(k, dim=-1)
        kth = vals[:, -1:]
        for r in ((x == kth).sum(-1) > (vals == kth).sum(-1)).nonzero()[:, 0].tolist():  # a tie the k-th place cuts
            above = (x[r] > kth[r]).nonzero()[:, 0]
            ids[r] = torch.cat([above, (x[r] == kth[r]).nonzero()[:, 0][:k - len(above)]])  # the lowest tied ids
            vals[r] = x[r, ids[r]]
        by_id = ids.argsort(dim=-1)
        ids, vals = ids.gather(1, by_id), vals.gather(1, by_id)
        order = vals.argsort(dim=-1, descending=True, stable=True)  # ties keep their ids' order
        out += [list(zip(i, v)) for i, v in zip(ids.gather(1, order).tolist(), vals.gather(1, order).tolist())]
    return out

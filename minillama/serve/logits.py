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


def prompt_logprobs(rows: torch.Tensor, prompt: Sequence[int], top_k: int) -> list[PromptLogprob]:
    """Echo / prompt_logprobs: each prompt token's log-prob given the tokens before it and its rank there (1: the
    likeliest; None for the first token), with the top-k at its position. rows: (P, vocab) the prompt's
    log-softmax rows, row t predicting prompt token t + 1."""
    nxt = torch.tensor(prompt[1:], dtype=torch.long, device=rows.device)
    picked = rows[:-1].gather(1, nxt[:, None])  # (P - 1, 1)
    chosen = picked[:, 0].tolist()
    ranks = ((rows[:-1] > picked).sum(dim=1) + 1).tolist()
    out: list[PromptLogprob] = [(None, None, [])]
    if top_k and len(nxt):
        vals, ids = rows[:-1].topk(min(top_k, rows.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in chosen]
    out.extend(zip(chosen, ranks, tops))
    return out

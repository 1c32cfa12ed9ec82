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

    def apply(row: torch.Tensor) -> torch.Tensor:  # row: (vocab,)
        x = row
        if dropped is not None:
            x = x.masked_fill(dropped.to(x.device), float("-inf"))
        if use_min_p:
            # p_i / p_max = exp((x_i - x_max) / T), in float64 so that a tiny temperature cannot overflow.
            z = (x.double() - x.double().max()) / temperature
            x = x.masked_fill(z < math.log(min_p), float("-inf"))
        return x

    return apply

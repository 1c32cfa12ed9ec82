"""How far a candidate may be from the reference: elementwise tolerances, as `torch.allclose` reads them
(|candidate - reference| <= atol + rtol * |reference|), for logits, log-probabilities and activations, and
the presets for each kind of candidate.
"""

from __future__ import annotations

from dataclasses import dataclass


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

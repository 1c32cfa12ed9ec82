"""Benchmarks: parallel prompting against the ways people answer many questions about one document.

    python -m minillama.bench              # default preset, a few minutes on 2 CPU cores
    python -m minillama.bench --quick      # tiny random model, seconds (the CI smoke run)
    python -m minillama.bench --full       # every method on every question, no extrapolation
    python -m minillama.bench --random     # random weights with the default model's shape (same speed)
    python -m minillama.bench --random llama3.2-1b --only many   # the task at a named shape, llama.cpp beside

The task is the synthetic one of the parallel-prompting paper, generated here: a document of filler text
holding facts "The {animal} named {name} has {part} that is {color}.", questions "What color is the
{part} of the {animal} named {name}?", and the color as the expected answer. Knobs: document length in
tokens, unique documents, questions per document, question length, answer length (max new tokens).
EOS is ignored, so every method generates the same number of tokens.

Methods, all on the same prompt token ids (`api.prompt_ids`, one stand-alone prompt per question):

- `independent`        each question alone, batch-invariant ops (the bit-exact reference)
- `independent_plain`  each question alone, `model.invariant = False` (plain F.linear + masked SDPA);
                       the faster of the two, so the headline baseline
- `batched`            every prompt its own root segment in one packed batch: the document's KV is
                       computed and stored once per question (what a batched `generate` user gets)
- `seqbatch`           the paper's baseline: one stream, document, q1, a1, q2, a2, ...
- `parallel`           the paper's method: document once, all questions in one packed prefill, then one
                       token per question per forward pass
- `parallel_plain`     parallel with `model.invariant = False`: what bit-exactness costs the method
- `hf_batched`         HF transformers `generate`, left-padded batch, fp32, SDPA, the same weights
- `hf_prefix`          HF transformers with the document's KV cache computed once and copied into every
                       row of the batch (`past_key_values`), the questions middle-padded after it
- `llamacpp`           llama.cpp (llama-cpp-python, optional) on an F32 GGUF of the same weights: each
                       document's prefix decoded once and shared by every question's sequence, all
                       questions' tokens in one batch, then one batch per decode step (`bench.llamacpp`)

Measured per method: wall time of generation (model load excluded), prefill and decode apart, process
CPU time, generated tokens/s, peak resident memory above the start of the run, KV-cache bytes, answers
that contain the color, answers token-identical to `independent`. FLOPs are counted analytically
(`CostModel`); the machine's fp32 GEMM rate is measured in the same run and each method's useful FLOP/s
is reported as a fraction of it. Methods are run round-robin, repeat after repeat, and the medians are
reported: this machine is noisy, so compare ratios taken within one run.

The peers are optional: without transformers or llama-cpp-python their methods are skipped with a note.
`--methods` keeps some methods in every case; every record counts its answers token-identical to
parallel's (which runs every question), beside the sampled comparison with `independent`.

Methods whose cost grows with the number of questions times the document (all but parallel and
hf_prefix) can run on a sample of the questions (`--sample K`): their times, FLOPs and (for batches) KV
bytes are then scaled by n / K and the record says `measured_questions`. Each question of `independent`
is a separate run, so for it the scaling is exact; for a batch, or seqbatch's shorter stream, it is an
estimate. `--full` samples nothing in the headline.

Outputs under --out (default bench_results/): results.json (everything), results.csv (one row per
sweep point and method), summary.md (tables), and PNG plots.

The package, one concern per module: `task` (the synthetic task, a word tokenizer), `cost` (FLOPs, the
GEMM rate), `memory` (peak RSS), `methods` (minillama's own methods), `hf` (the HF transformers peers),
`llamacpp` and `gguf_f32` (the llama.cpp peer and the F32 GGUF it runs), `shapes` (named shapes, random
weights), `runner` (one case: round-robin repeats, medians, records), `presets`, `report` (tables,
findings, files), `plots`, `profile` (where the time goes) and `command`.
"""

from .command import main
from .cost import CostModel, gemm_rate
from .methods import METHODS, SAMPLED, Context, Measured
from .presets import preset
from .report import findings, headline_table, target_rows, write_outputs
from .runner import RUNNERS, Case, run, run_case, setup
from .shapes import SMOLLM2_SHAPE, TINY_SHAPE, random_llama
from .task import Task, TaskConfig, WordTokenizer, make_task, plain_prompt_ids

__all__ = ["main", "CostModel", "gemm_rate", "METHODS", "SAMPLED", "Context", "Measured", "preset", "findings",
           "headline_table", "target_rows", "write_outputs", "RUNNERS", "Case", "run", "run_case", "setup",
           "SMOLLM2_SHAPE", "TINY_SHAPE", "random_llama", "Task", "TaskConfig", "WordTokenizer", "make_task",
           "plain_prompt_ids"]

"""Random weights at a named shape, on any device, against that device's roofline; no checkpoint, no tokenizer.

    python -m minillama.bench --shape llama3-8b --device cuda --dtype bfloat16          # GPU headline
    python -m minillama.bench --shape llama3-8b --device cuda --dtype bfloat16 --tables # + paper Tables 3/4
    python -m minillama.bench --shape tiny --device cpu --tiny                          # seconds, on CPU

The task is token ids drawn at random with the right lengths: one document of D tokens shared by Q
questions of q tokens each (several documents for Table 4), G new tokens, EOS ignored. Side by side, in
one run, round-robin repeats, medians:

- `parallel`        the paper's method, batch-invariant kernels
- `parallel_plain`  the same with `model.invariant = False`
- `independent`     each question alone, on a sample of the questions (`--sample`), times scaled to all
- `hf_batched`      HF transformers `generate`, left-padded, sdpa, the same weights and dtype, the same ids
                    (when transformers is importable)
- `parallel_eager`  on CUDA, `parallel` with every step run eagerly rather than captured (step.py)
- `parallel_in_step` on CUDA, `parallel` with each decode step read back before the next is laid out, the
                    host not one step ahead (`Steps.overlap = False`, generate._decode)
- `parallel_compiled` with `--compiled`: `parallel` with each step's layers through torch.compile (step.py);
                    the process's first compiled run, timed apart (`meta.compiled_first_run_s`), holds the
                    compiles of its shapes (from the disk cache where an earlier process left them)

The same run measures the device's GEMM rate (a square matmul in the run's dtype) and memory bandwidth
(a large copy) and reports each method against the roofline floor of the work: the prefill's FLOPs at the
GEMM rate, plus each decode step reading every weight once at the bandwidth. Generated tokens per second
are reported as the paper does (questions x new tokens / generation time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import LlamaConfig
from ..generate import SamplingParams, generate
from ..precision import describe
from ..weights import build_model
from .cost import CostModel, fastest_gemm_s
from .parity import parity
from .shapes import SHAPES


@dataclass(frozen=True)
class IdTask:
    doc_tokens: int = 512
    n_docs: int = 1
    questions: int = 64  # in all, spread evenly over the documents
    question_tokens: int = 12
    new_tokens: int = 8
    label: str = ""

    def describe(self) -> str:
        docs = f"{self.n_docs} docs of {self.doc_tokens}" if self.n_docs > 1 else f"doc {self.doc_tokens}"
        return (f"{self.label}: {docs}, {self.questions} questions of {self.question_tokens} tokens, "
                f"{self.new_tokens} new tokens")

    def build(self, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        """Prompts (document ids + question ids) and each prompt's document index. Ids avoid 0-2 (pad,
        BOS, EOS in most vocabularies) so that no method meets a special token."""
        g = torch.Generator().manual_seed(seed)
        ids = lambda n: (torch.randint(3, vocab, (n,), generator=g)).tolist()  # noqa: E731
        docs = [ids(self.doc_tokens) for _ in range(self.n_docs)]
        prompts, which = [], []
        for i in range(self.questions):
            d = i * self.n_docs // self.questions
            prompts.append(docs[d] + ids(self.question_tokens))
            which.append(d)
        return prompts, which


HEADLINE = IdTask(label="headline")
# The paper's Table 3 (one document of 512 tokens, questions of 12 tokens, 5 answer tokens, 128/256/512
# questions) and Table 4 (128 questions over 8 documents of 256/512/1024 tokens).
PAPER_TABLES = ([IdTask(512, 1, q, 12, 5, "Table 3") for q in (128, 256, 512)]
                + [IdTask(d, 8, 128, 12, 5, "Table 4") for d in (256, 512, 1024)])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(config: LlamaConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Any, dict]:
    """minillama's model with random weights drawn on the device (std 0.02, norms 1), and the state dict
    (HF names) so that HF transformers can hold the very same tensors. Its products are issued whole (one
    unit), as the shape bench's methods run, its figures since the first GPU run too; `parallel_units` runs
    at the default units, the KV heads (`run`'s `units`)."""
    from ..model import Llama

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Llama(config).state_dict().items()}
    sd = {}
    for name, shape in shapes.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            sd[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            sd[name] = (torch.randn(shape, device=device, dtype=torch.float32, generator=g) * 0.02).to(dtype)
    model = build_model(config, dict(sd), device, dtype)
    model.units = 1
    return model, sd


def hf_model(config: LlamaConfig, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    """HF transformers' LlamaForCausalLM (sdpa) holding the same tensors."""
    import transformers

    hf_config = transformers.LlamaConfig(**{**config.to_dict(), "hidden_act": "silu"})
    hf_config._attn_implementation = "sdpa"
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the run's dtype on the device: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(saved)
    full = dict(sd)
    if config.tie_word_embeddings:
        full["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(full, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config.eos_token_id = None  # EOS ignored, as in every method here
    return model.to(device=device, dtype=dtype).eval()


def gemm_tflops(device: torch.device, dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    """TFLOP/s of one (n, n) @ (n, n) product in `dtype` on the device, by the faster of torch's GEMMs
    (`cost.fastest_gemm_s`), so that a fraction of it is a fraction of what this torch can do."""
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / fastest_gemm_s(a, b, repeats, sync=lambda: _sync(device)) / 1e12


def bandwidth_gbs(device: torch.device, mib: int = 1024, repeats: int = 5) -> float:
    """GB/s of a large device-to-device copy (bytes read + bytes written): the median of `repeats`."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times) / 1e9


def floor_s(config: LlamaConfig, prompts: list[list[int]], docs: list[int], g: int, weight_bytes: int,
            tflops: float, gbs: float) -> dict[str, float]:
    """The roofline floor of answering every question: the least prefill work (each document once,
    `CostModel.parallel`) at the GEMM rate, plus g - 1 decode steps that each read every weight once."""
    prefill = CostModel(config).parallel(prompts, docs, g)["prefill"]
    gemm_s, read_s = prefill / (tflops * 1e12), (g - 1) * weight_bytes / (gbs * 1e9)
    return {"floor_s": gemm_s + read_s, "floor_gemm_s": gemm_s, "floor_weights_s": read_s, "prefill_flops": prefill}


def _run_minillama(model: Any, prompts: list[list[int]], docs: list[int], g: int, mode: str,
                   invariant: bool, captured: bool | None = None, compiled: bool = False,
                   overlap: bool | None = None) -> list[list[int]]:
    """Token ids of every prompt; `captured`: the steps' capture setting for this run (None: the default);
    `compiled`: the steps' layers through torch.compile; `overlap`: decoding ahead of the host (step.py; None:
    the model's own setting, which gpu_check's fallback sets False where decoding ahead failed)."""
    steps = model.steps
    saved = model.invariant, steps.captured, steps.compiled, steps.overlap
    model.invariant, steps.captured, steps.compiled = invariant, captured, compiled
    steps.overlap = steps.overlap if overlap is None else overlap
    try:
        out = generate(model, prompts, SamplingParams(max_new_tokens=g, ignore_eos=True), mode=mode, docs=docs)
    finally:
        model.invariant, steps.captured, steps.compiled, steps.overlap = saved
    return [a.token_ids for a in out]


def compiled_run_s(model: Any, task: IdTask, device: torch.device) -> float:
    """Seconds of one `parallel` run of `task` with compiled steps; a process's first holds the compiles of its
    shapes (or, from a warm cache directory, their tracing and loading: bench/warm.py)."""
    prompts, docs = task.build(model.config.vocab_size)
    _sync(device)
    t0 = time.perf_counter()
    _run_minillama(model, prompts, docs, task.new_tokens, "parallel", invariant=True, compiled=True)
    _sync(device)
    return time.perf_counter() - t0


def shrunk(task: IdTask, tiny: bool) -> IdTask:
    """`task` with every size divided down where `tiny` (seconds on a CPU), else itself."""
    if not tiny:
        return task
    return dataclasses.replace(task, doc_tokens=max(8, task.doc_tokens // 16), questions=max(2, task.questions // 16),
                               question_tokens=max(2, task.question_tokens // 4), new_tokens=min(task.new_tokens, 3))


def _run_hf(hf: Any, prompts: list[list[int]], g: int, device: torch.device) -> list[list[int]]:
    m = max(map(len, prompts))
    ids = torch.tensor([[0] * (m - len(p)) + p for p in prompts], device=device)  # (B, m), left-padded
    mask = torch.tensor([[0] * (m - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=g, min_new_tokens=g, do_sample=False,
                          pad_token_id=0)
    return out[:, m:].tolist()


def _sample(n: int, k: int) -> list[int]:
    return sorted({round(j * n / k) for j in range(min(k, n))})


def run_task(task: IdTask, model: Any, hf: Any, device: torch.device, methods: tuple[str, ...], repeats: int,
             sample: int, rates: dict[str, float], log: Callable[[str], None] = print,
             units_model: Any = None) -> list[dict[str, Any]]:
    """Every method on one task: a warm-up, then `repeats` round-robin rounds; one record per method.
    `units_model`: the same weights at the CLI's default units (the KV heads), which `parallel_units` runs."""
    config = model.config
    prompts, docs = task.build(config.vocab_size)
    g, n = task.new_tokens, len(prompts)
    idx = {m: (_sample(n, sample or n) if m == "independent" else list(range(n))) for m in methods}

    def once(m: str) -> tuple[float, list[list[int]]]:
        ps, ds = [prompts[i] for i in idx[m]], [docs[i] for i in idx[m]]
        _sync(device)
        t0 = time.perf_counter()
        if m == "hf_batched":
            out = _run_hf(hf, ps, g, device)
        else:
            out = _run_minillama(units_model if m == "parallel_units" else model, ps, ds, g,
                                 "independent" if m == "independent" else "parallel",
                                 invariant=m != "parallel_plain", captured=False if m == "parallel_eager" else None,
                                 compiled=m == "parallel_compiled", overlap=False if m == "parallel_in_step" else None)
        _sync(device)
        return time.perf_counter() - t0, out

    first = {m: once(m)[0] for m in methods}  # warm-up: kernels chosen (or compiled), caches allocated
    times: dict[str, list[float]] = {m: [] for m in methods}
    answers: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        for m in methods:
            t, answers[m] = once(m)
            times[m].append(t)
            log(f"  {task.describe()} {m} {r + 1}/{repeats}: {t:.3f} s ({len(idx[m])} questions)")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fl = floor_s(config, prompts, docs, g, weight_bytes, rates["gemm_tflops"], rates["bandwidth_gbs"])
    par = dict(zip(idx["parallel"], answers["parallel"])) if "parallel" in answers else {}
    records = []
    for m in methods:
        scale = n / len(idx[m])
        wall = statistics.median(times[m]) * scale
        same = sum(par.get(i) == a for i, a in zip(idx[m], answers[m])) if par else None
        records.append({**dataclasses.asdict(task), "case": task.describe(), "method": m, "questions_run": len(idx[m]), "scaled_by": scale,
                        "repeats": repeats, "wall_s": wall, "wall_s_all": [t * scale for t in times[m]],
                        "first_s": first[m] * scale,
                        "generated_tokens": n * g, "tokens_per_s": n * g / wall, "x_floor": wall / fl["floor_s"],
                        "same_tokens_as_parallel": same, **fl, "weight_bytes": weight_bytes})
    return records


def dtype_sweep(config: LlamaConfig, device: torch.device, task: IdTask, repeats: int,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`parallel` on one task in float32, bfloat16 and float16 (the same random weights, rounded), side by side
    in round-robin repeats: each dtype's median time against float32's, and the path its products took."""
    names = ("float32", "bfloat16", "float16")
    models = {n: random_model(config, device, getattr(torch, n))[0] for n in names}
    prompts, docs = task.build(config.vocab_size)

    def once(n: str) -> float:
        _sync(device)
        t0 = time.perf_counter()
        _run_minillama(models[n], prompts, docs, task.new_tokens, "parallel", invariant=True)
        _sync(device)
        return time.perf_counter() - t0

    for n in names:  # warm-up
        once(n)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names:
            times[n].append(once(n))
            log(f"  {task.describe()} parallel in {n} {r + 1}/{repeats}: {times[n][-1]:.3f} s")
    base = statistics.median(times["float32"])
    return [{"case": task.describe(), "dtype": n, "products": describe(device, getattr(torch, n)),
             "wall_s": statistics.median(times[n]), "wall_s_all": times[n],
             "x_float32": statistics.median(times[n]) / base} for n in names]


def dtype_table(records: list[dict[str, Any]]) -> str:
    lines = ["| case | dtype | products | wall s | x float32 |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['dtype']} | {r['products']} | {r['wall_s']:.3f} | {r['x_float32']:.2f} |"
              for r in records]
    return "\n".join(lines)


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| case | method | questions run | wall s | first run s | generated tok/s | x roofline floor | "
             "same tokens as parallel |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        ran = f"{r['questions_run']} of {r['questions']}, x{r['scaled_by']:g}" if r["scaled_by"] != 1 else \
            str(r["questions"])
        first = f"{r['first_s']:.3f}" if "first_s" in r else "-"  # results from before the warm-up was kept
        lines.append(f"| {r['case']} | {r['method']} | {ran} | {r['wall_s']:.3f} | {first} | {r['tokens_per_s']:.0f} | "
                     f"{r['x_floor']:.1f} | {r['same_tokens_as_parallel']}/{r['questions_run']} |")
    return "\n".join(lines)


def shape_main(shape: str, device_name: str, dtype_name: str, tiny: bool, tables: bool, repeats: int, sample: int,
               use_hf: bool, log: Callable[[str], None] = print, tp: int = 1,
               dtypes: bool = False, parity_check: bool = False, compiled: bool = False,
               units: bool = False) -> dict[str, Any] | None:
    """The whole run: rates, the headline with every method, the paper's tables with parallel alone.
    tp > 1: this is one rank of torchrun's; the model is sharded (distributed/tp.py), rank 0 returns the
    results and the others None. `dtypes`: also the headline's `parallel` in every dtype (`dtype_sweep`).
    `parity_check`: first, parallel against independent logits bit for bit (bench/parity.py); `compiled`:
    the headline also with compiled steps (`parallel_compiled`), and the parity check too; `units`: the headline
    also at the units `minillama generate` takes by default, the KV heads (`parallel_units`; the other methods
    run at one unit), and the parity check there too."""
    dtype = getattr(torch, dtype_name)
    config = SHAPES[shape]
    here = None
    if tp > 1:
        import argparse

        from ..distributed import parallel

        opts = argparse.Namespace(tp=tp, units=None, device=device_name, dist_timeout=600.0)
        here = parallel.join(opts)  # on a GPU machine, cuda:LOCAL_RANK
        device_name, use_hf = opts.device, False
        if here.world.rank != 0:
            log = lambda s: None  # noqa: E731
    device = torch.device(device_name)
    t0 = time.perf_counter()
    model, sd = random_model(config, device, dtype)
    if here is not None:
        parallel.place(model, opts, here)
        del sd
    hf = hf_model(config, sd, device, dtype) if use_hf else None
    log(f"random {shape} on {device} in {dtype_name}, products: {describe(device, dtype)} (setup {time.perf_counter() - t0:.1f} s)")
    small = dict(n=256, mib=64) if tiny else dict(n=4096, mib=1024)
    rates = {"gemm_tflops": gemm_tflops(device, dtype, small["n"]), "bandwidth_gbs": bandwidth_gbs(device, small["mib"])}
    log(f"device: GEMM {rates['gemm_tflops']:.2f} TFLOP/s ({dtype_name}), copy bandwidth {rates['bandwidth_gbs']:.0f} GB/s")
    headline = shrunk(HEADLINE, tiny)
    first_compile = {}
    if compiled:  # the process's first compiled run, before anything else compiles: the compiles of its shapes
        first_compile["compiled_first_run_s"] = compiled_run_s(model, headline, device)
        log(f"first compiled run of the headline (its compiles): {first_compile['compiled_first_run_s']:.1f} s")
    units_model = None
    if units and here is None:  # the same tensors, laid out for the units (their own graphs and layout)
        units_model = build_model(config, dict(sd), device, dtype)  # at the default units, the KV heads
    checked = []
    if parity_check:
        sizes = dict(doc_tokens=40, questions=4, lengths=(2, 6), new_tokens=3) if tiny else {}
        checked = parity(model, log=log, compiled=compiled, **sizes)
        if units_model is not None:
            checked += parity(units_model, log=log, controls=False, **sizes)
    methods = ("parallel", "parallel_plain", "independent") + (("hf_batched",) if hf is not None else ()) + \
        (("parallel_eager",) if model.steps.capturing(model.device) else ()) + \
        (("parallel_in_step",) if model.steps.overlapping(model.device) else ()) + \
        (("parallel_compiled",) if compiled else ()) + (("parallel_units",) if units_model is not None else ())
    records = run_task(headline, model, hf, device, methods, repeats, sample, rates, log, units_model)
    if tables:
        for t in PAPER_TABLES:
            records += run_task(shrunk(t, tiny), model, None, device, ("parallel",), repeats, sample, rates, log)
    by_dtype = dtype_sweep(config, device, headline, repeats, log) if dtypes else []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if here is not None and not here.leave():
        return None  # rank 0 reports
    return {"meta": {"shape": shape, "device": str(device), "device_name": name, "dtype": dtype_name, "tiny": tiny,
                     "products": describe(device, dtype),
                     "torch": torch.__version__, "threads": torch.get_num_threads(), "tp": tp, **rates,
                     **first_compile},
            "records": records, "dtypes": by_dtype, "parity": checked}

"""The oracle: minillama as the reference another backend is checked against.

    python -m minillama.oracle export  -o ref.safetensors          # greedy answers + every step's logits
    python -m minillama.oracle compare --backend transformers      # HF on the same checkpoint, same tokens
    python -m minillama.oracle compare --reference ref.safetensors --candidate mine.jsonl

- schema.py      the record types: what a run answered, per question (QuestionRecord, Record, RecordError)
- record.py      a record made from minillama's run (export), saved and loaded (safetensors, JSONL)
- backends.py    minillama, HF transformers (eager, fp32; HF directory or GGUF via gguf_file=), llama.cpp;
                 logits and named activations of one token sequence
- server.py      any OpenAI-compatible server, teacher-forced through echoed prompt log-probs
- tolerances.py  elementwise tolerances and their presets
- diff.py        per question: first divergent step, logit/logprob errors, top-k overlap, verdict; hints from
                 the pattern of the errors
- layers.py      the layer diff that names the first layer and sub-module out of tolerance
- report.py      the report a person reads
- under_load.py  `oracle load`: a server's answers alone, again, cold, streamed and under load, compared per cause
- __main__.py    the command line

In Python:

    from minillama.oracle import export, run_backend, compare, TransformersBackend
    ref = export(model, prompts, max_new_tokens=16)
    results = compare(ref, run_backend(ref, TransformersBackend.load("weights/smollm2-135m-instruct")))
"""

from .backends import (Activations, Backend, BackendError, LlamaCppBackend, MinillamaBackend, TransformersBackend,
                       activation_names, load_backend)
from .diff import Comparison, QuestionResult, compare, hints, run_backend
from .layers import LayerDiff, diff_layers, layer_diff
from .record import QuestionRecord, Record, RecordError, export, load, save
from .report import report
from .server import OpenAIBackend
from .tolerances import PRESETS, Tolerances

__all__ = [
    "Activations", "Backend", "BackendError", "LlamaCppBackend", "MinillamaBackend", "TransformersBackend",
    "activation_names", "load_backend", "OpenAIBackend", "PRESETS", "hints", "Comparison", "LayerDiff", "QuestionResult", "Tolerances", "compare",
    "diff_layers", "layer_diff", "report", "run_backend", "QuestionRecord", "Record", "RecordError", "export",
    "load", "save",
]

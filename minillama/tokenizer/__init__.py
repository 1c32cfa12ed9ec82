"""One tokenizer interface over the two kinds Llama checkpoints ship, and their chat templates.

- `SentencePieceTokenizer` (spm.py): a sentencepiece model (`tokenizer.model`, Llama 1/2 family), or one
  rebuilt from a GGUF `llama` vocabulary (pieces, scores and types are sentencepiece's own, so the rebuilt
  model tokenizes exactly as sentencepiece does).
- `HFTokenizer` (bpe.py): the `tokenizers` library, from a `tokenizer.json` or built from a GGUF `gpt2`
  (byte-level BPE) vocabulary and merges, the way llama.cpp splits text for that vocabulary.
- `Tokenizer` (base.py): the interface both implement, with chat templates; `load_tokenizer` (load.py)
  builds the right one for a checkpoint, a GGUF file's from its metadata (gguf_vocab.py).

Control tokens written in text ("<|im_start|>" in a rendered chat prompt) become their ids in both,
unless `parse_special=False`. Chat templates are the checkpoint's own Jinja source, rendered the way HF
transformers renders them (`apply_chat_template`: a sandboxed environment with `raise_exception`,
`strftime_now` and `tojson`). `encode_chat` tokenizes a rendered chat so that only the template's own
markers are control tokens: "<|im_end|>" written in a document is text, it cannot close a turn.
"""

from .base import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, Tokenizer, TokenizerError
from .bpe import BPE_PRE_TOKENIZERS, HFTokenizer, byte_bpe_tokenizer
from .gguf_vocab import gguf_values, read_gguf_tokenizer_metadata, tokenizer_from_gguf_metadata
from .load import load_tokenizer
from .spm import SentencePieceTokenizer, sentencepiece_proto

__all__ = [
    "BYTE", "CONTROL", "NORMAL", "UNKNOWN", "UNUSED", "USER_DEFINED", "Tokenizer", "TokenizerError",
    "BPE_PRE_TOKENIZERS", "HFTokenizer", "byte_bpe_tokenizer", "gguf_values", "load_tokenizer",
    "read_gguf_tokenizer_metadata", "tokenizer_from_gguf_metadata", "SentencePieceTokenizer", "sentencepiece_proto",
]

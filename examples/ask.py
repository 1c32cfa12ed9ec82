"""The examples/ job through the Python API: `python examples/ask.py`, from anywhere.

With minillama installed (`pip install .`) this imports the installed package; run from a clone without
installing, it imports the clone's own `minillama/`, one directory up.
"""

import sys
from pathlib import Path

try:
    from minillama import api
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from minillama import api

here = Path(__file__).parent
doc = (here / "doc.txt").read_text()
questions = [q.strip() for q in (here / "questions.txt").read_text().splitlines() if q.strip()]

model = api.load()  # the default model, SmolLM2-135M-Instruct, fetched and converted on first use
for reply in api.ask(model, doc, questions, max_new_tokens=32):
    print(f"Q: {reply.question}\nA: {reply.text}  ({len(reply.token_ids)} tokens, {reply.finish_reason})\n")

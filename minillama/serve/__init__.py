"""`minillama serve`: an OpenAI-compatible server whose answers do not depend on who else is asking.

engine.py batches requests continuously and reuses cached prompt prefixes (prefix.py); app.py is the HTTP
layer, schema.py checks requests and answers.py writes the answers; cli.py the command line. docs/serve.md
describes the promise and its tests.
"""

"""`python -m minillama.serve`: the same as `minillama serve`."""

from .cli import main

raise SystemExit(main())

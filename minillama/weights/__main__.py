"""`python -m minillama.weights`: the `minillama weights` command (cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m minillama.bench`."""

from minillama.bench import main

raise SystemExit(main())

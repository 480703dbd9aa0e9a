"""`python -m warpspec`: the `warpspec` command line."""

from warpspec.cli import main

raise SystemExit(main())

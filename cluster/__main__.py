"""`python -m warpspec`: the `warpspec` command line."""

from warpspec.cli.main import main

raise SystemExit(main())

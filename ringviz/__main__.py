"""`python -m ringviz ...` runs the command-line interface."""

from ringviz.cli import main

raise SystemExit(main())

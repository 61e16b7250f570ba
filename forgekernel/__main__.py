"""`python -m forgekernel`: the same command line as the `forgekernel` script."""

from forgekernel.cli import main

raise SystemExit(main())

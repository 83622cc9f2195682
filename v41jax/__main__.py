"""`python -m v41jax`: the `v41jax` command."""

from v41jax.cli import main

raise SystemExit(main())

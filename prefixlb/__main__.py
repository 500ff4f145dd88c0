"""``python -m prefixlb`` is the ``prefixlb`` command."""
from prefixlb.cli import main

raise SystemExit(main())

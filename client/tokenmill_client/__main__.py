"""``python -m tokenmill_client`` runs the tokenmill-client command line."""

from .cli import main

raise SystemExit(main())

"""``python -m tokenmill_client.cli``, as the module ran before it became a package."""

from . import main

raise SystemExit(main())

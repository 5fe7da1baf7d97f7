"""The console scripts' entry points, importable with the base (client-only) install.

`pip install tokenmill` puts `tokenmill-server` and `tokenmill-bench` on the PATH too; without the
server extra they say how to get it instead of failing with a ModuleNotFoundError traceback.
Standard library only, up to the moment the real command is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _run(command: str, load: Callable[[], Callable[[], int]]) -> int:
    try:
        main = load()
    except ModuleNotFoundError as exc:
        sys.stderr.write(
            f"{command}: the server's dependencies are not installed (no module named {exc.name!r}); "
            "install them with: pip install 'tokenmill[server]'\n"
        )
        return 1
    return main()


def server() -> int:
    def load() -> Callable[[], int]:
        from tokenmill_service.front.worker_processes import start_preloading

        start_preloading(sys.argv[1:])  # the workers' imports, beside the router's
        from tokenmill_service.front.main import main

        return main

    return _run("tokenmill-server", load)


def bench() -> int:
    def load() -> Callable[[], int]:
        from tokenmill_bench.cli import main

        return main

    return _run("tokenmill-bench", load)

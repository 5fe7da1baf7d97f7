"""A module the fork server test preloads: at the fork server's exit, if the exit runs the interpreter's exit
handlers, this one writes the file TOKENMILL_FORK_SERVER_PROBE names."""

from __future__ import annotations

import atexit
import os
from pathlib import Path


def _mark() -> None:
    target = os.environ.get("TOKENMILL_FORK_SERVER_PROBE")
    if target:
        Path(target).write_text("torn down\n")


atexit.register(_mark)

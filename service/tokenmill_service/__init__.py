"""tokenmill server: the router, worker processes and the inference engine."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("tokenmill")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

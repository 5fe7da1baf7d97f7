"""The public API's generated code, imported from this one place by the service.

It is generated into the client package (scripts/gen_proto.py), which the server depends on.
"""

from __future__ import annotations

from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]

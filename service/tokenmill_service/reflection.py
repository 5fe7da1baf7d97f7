"""gRPC server reflection under both names clients ask for: v1 (grpcurl, Postman and newer tools try
it first) and v1alpha (older ones). grpcio-reflection ships v1alpha only; the two protocols are the
same messages under another package name, so one servicer answers both."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    services = (reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = ReflectionServicer((*service_names, *services))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString,
    )
    for name in services:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )

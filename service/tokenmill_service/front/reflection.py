"""gRPC server reflection under both names clients ask for: v1 (grpcurl, Postman and newer tools try
it first) and v1alpha (older ones). grpcio-reflection ships v1alpha only; the two protocols are the
same messages under another package name, so one servicer answers both. With --auth-token set, reflection
asks for the token too."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(
    service_names: Sequence[str], server: grpc.aio.Server, authorized: Callable[[str | None], bool] | None = None
) -> None:
    """Reflection for ``service_names``; behind the bearer token where ``authorized`` is given (a server with a
    token keeps its API's description to the callers that hold one, as it keeps the API itself)."""
    services = (reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = ReflectionServicer((*service_names, *services))

    async def info(
        requests: AsyncIterator[rpb.ServerReflectionRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[rpb.ServerReflectionResponse]:
        if authorized is not None and not authorized(dict(context.invocation_metadata() or ()).get("authorization")):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token in the 'authorization' metadata: this server's reflection, like its "
                "API, needs its --auth-token",
            )
        async for response in servicer.ServerReflectionInfo(requests, context):
            yield response

    handler = grpc.stream_stream_rpc_method_handler(
        info,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString,
    )
    for name in services:
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )

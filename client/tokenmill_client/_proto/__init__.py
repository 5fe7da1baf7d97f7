"""Code generated from protos/tokenmill/v1/*.proto by scripts/gen_proto.py: do not edit by hand.

``generate_pb2`` holds the messages (typed by ``generate_pb2.pyi``); ``generate_pb2_grpc`` holds the
untyped gRPC stub and servicer base (the server uses ``add_GenerationServicer_to_server``; the client
uses its own typed wrappers in ``tokenmill_client._stubs``).
"""

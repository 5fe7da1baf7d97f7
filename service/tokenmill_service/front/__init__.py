"""The server process: gRPC and HTTP APIs, the router, validation, metrics. Never imports torch."""

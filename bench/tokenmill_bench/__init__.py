"""tokenmill-bench: latency, throughput and memory-bandwidth benchmark of a tokenmill server over gRPC."""

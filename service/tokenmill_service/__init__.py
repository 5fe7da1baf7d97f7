"""tokenmill server: the router, worker processes and the inference engine."""

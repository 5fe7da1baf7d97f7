"""The worker process: the engine, the load plan, the models, layers, kernels, distributed ranks."""

"""The load plan, resolved in the worker: what the device offers, and every choice with its reason."""

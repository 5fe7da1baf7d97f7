"""One place decides what runs: ``LoadOptions`` (what was asked) -> ``resolve_plan`` -> ``LoadPlan``.

Importing this package does not import torch (the server process ships the options and reads the
plan's summary); ``worker.plan.resolve`` and ``worker.device`` do, in the worker.
"""

from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.contract.plan.plan import EXECUTORS, Decision, LayerChoice, LoadPlan, PlanRefused

__all__ = ["EXECUTORS", "Decision", "LayerChoice", "LoadOptions", "LoadPlan", "PlanRefused"]

"""LoRA adapters as a side path of the linear layers: adapters read from PEFT directories
(``adapter.py``), stacked in resident slots on each linear layer (``slots.py``), and the batched
per-slot product that adds each sequence's delta (``sgmv.py``)."""

from tokenmill_service.worker.layers.lora.adapter import AdapterError, LoRAAdapter, read_adapter
from tokenmill_service.worker.layers.lora.slots import LoRABatch, LoRALayer, LoRASlots, attach_lora

__all__ = ["AdapterError", "LoRAAdapter", "LoRABatch", "LoRALayer", "LoRASlots", "attach_lora", "read_adapter"]

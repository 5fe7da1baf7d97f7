"""The float32 reference for a file too large to hold dequantized, one decoder layer in memory at a time.

transformers' GGUF loading dequantizes the whole file before it computes anything: 32 GB of float32 for an
8B model, more than many machines that serve one have. Here the same pieces run in another order: each
tensor is dequantized as that loading does it (gguf's ``dequantize``, then transformers' tensor processor,
which undoes the file's query/key permutation, and its map from the file's names to the model's), every
sequence is carried through one layer of transformers' own modules, and that layer's weights are dropped
before the next layer is read. The operations and their shapes are the loading's own, so the logprobs are
the same bits (``tests/deploy/test_fidelity_bench.py`` compares both on the embedded model).

Families whose model is ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb`` and an ``lm_head`` (Llama,
Mistral, Qwen2 and their like) are supported; another is refused by name.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch


def next_token_logprobs(model_path: Path, sequences: list[list[int]]) -> list[list[float]]:
    """For each sequence, the float32 model's logprob of token p + 1 at each position p."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    body = model.model
    missing = [part for part in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(body, part)]
    if missing or not hasattr(model, "lm_head"):
        raise SystemExit(f"streamed reference: {type(model).__name__} has no {missing or ['lm_head']}")
    rotary = type(body.rotary_emb)(config=config)  # its frequencies computed here, not left on meta

    reader = GGUFReader(model_path)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    by_layer: dict[int | str, list[Any]] = defaultdict(list)
    for tensor in reader.tensors:
        by_layer[_group(tensor.name)].append(tensor)

    def weights(group: int | str) -> dict[str, torch.Tensor]:
        out = {}
        for tensor in by_layer[group]:
            result = processor.process(
                weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name, tensor_key_mapping=names
            )
            if result.name in names:
                out[names[result.name]] = torch.from_numpy(np.copy(result.weights))
        return out

    with torch.inference_mode():
        top = weights("top")
        body.embed_tokens.load_state_dict({"weight": top["model.embed_tokens.weight"]}, assign=True)
        states = []
        for sequence in sequences:
            hidden = body.embed_tokens(torch.tensor([sequence]))
            positions = torch.arange(len(sequence)).unsqueeze(0)
            mask = create_causal_mask(
                config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
            )
            states.append([hidden, positions, mask, rotary(hidden, position_ids=positions)])
        for index, layer in enumerate(body.layers[: config.num_hidden_layers]):
            prefix = f"model.layers.{index}."
            layer.load_state_dict(
                {name.removeprefix(prefix): w for name, w in weights(index).items()}, strict=True, assign=True
            )
            for state in states:
                hidden, positions, mask, rotation = state
                state[0] = layer(
                    hidden, attention_mask=mask, position_embeddings=rotation, position_ids=positions, use_cache=False
                )
            layer.to_empty(device="meta")  # this layer's weights go before the next one's come
        body.norm.load_state_dict({"weight": top["model.norm.weight"]}, assign=True)
        head = top.get("lm_head.weight", top["model.embed_tokens.weight"])  # tied where the file has no output
        model.lm_head.load_state_dict({"weight": head}, assign=True)
        out = []
        for sequence, (hidden, *_rest) in zip(sequences, states, strict=True):
            logprobs = torch.log_softmax(model.lm_head(body.norm(hidden))[0].double(), -1)
            out.append([logprobs[p, token].item() for p, token in enumerate(sequence[1:])])
    return out


def _group(gguf_name: str) -> int | str:
    """The file's ``blk.N.*`` tensors belong to layer N; the embedding, the final norm and the output to 'top'."""
    if gguf_name.startswith("blk."):
        return int(gguf_name.split(".")[1])
    return "top"

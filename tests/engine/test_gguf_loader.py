"""GGUF loading: dequantization against the gguf package's reference (every block format, k-quants
included), q/k row order end to end, and a Q4_K_M-style file loaded and served."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tokenmill_service.contract.model_dims import read_dims
from tokenmill_service.contract.parallel_degree import check_degree
from tokenmill_service.contract.plan import LoadOptions, PlanRefused
from tokenmill_service.worker.device import DeviceFacts
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.layers.quant import gguf_blocks
from tokenmill_service.worker.layers.quant.gguf_blocks import BLOCK_WEIGHTS, GGUFBlocks
from tokenmill_service.worker.loader import load, load_model
from tokenmill_service.worker.models.checkpoint import open_checkpoint
from tokenmill_service.worker.models.gguf_loader import (
    GGUFError,
    dequantize_tensor,
    load_gguf,
    open_gguf,
    unpermute_qk,
)
from tokenmill_service.worker.plan.resolve import resolve_plan

transformers = pytest.importorskip("transformers")

QUANTIZED_TYPES = [QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1]


def _encode(values: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F32:
        return values.astype(np.float32)
    if qtype == QType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def _write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, QType]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, qtype) in tensors.items():
        encoded = _encode(values, qtype)
        writer.add_tensor(name, encoded, raw_dtype=None if qtype in (QType.F32, QType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, *QUANTIZED_TYPES], ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bit_for_bit(tmp_path: Path, qtype: QType) -> None:
    rng = np.random.default_rng(0)
    # Includes an all-zero block (scale 0) and rows wider than one block.
    matrix = rng.normal(0.0, 1.0, size=(12, 96)).astype(np.float32)
    matrix[3, :32] = 0.0
    vector = rng.normal(0.0, 1.0, size=(64,)).astype(np.float32)
    path = tmp_path / "types.gguf"
    _write_tensors(path, {"matrix": (matrix, qtype), "vector": (vector, qtype)})

    reader = open_gguf(path)
    for tensor, original in zip(reader.tensors, (matrix, vector), strict=True):
        assert tensor.tensor_type == qtype
        ours = dequantize_tensor(tensor)
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert ours.dtype == torch.float32
        assert tuple(ours.shape) == original.shape
        np.testing.assert_array_equal(ours.numpy(), reference.reshape(original.shape))
        # And it is the tensor that was written, up to the format's rounding.
        assert np.abs(ours.numpy() - original).max() < 0.5


# Byte offsets of each block format's float16 scale fields (ggml's layouts): random blocks get small
# finite values there, so that no inf or nan can hide a difference.
SCALE_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.MXFP4: (),  # an e8m0 exponent byte (below)
}


def random_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Valid ``qtype`` bytes uint8 [rows, bytes per row]: random, the float16 scales in (-scale, scale)."""
    weights, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        halves = rng.uniform(-scale, scale, size=(rows, cols // weights, 1)).astype(np.float16)
        blocks[..., at : at + 2] = halves.view(np.uint8)
    if qtype == QType.MXFP4:  # 2^(e - 128) within 2^-20 .. 2^20: finite
        blocks[..., 0] = rng.integers(108, 148, size=blocks.shape[:-1], dtype=np.uint8)
    return blocks.reshape(rows, -1)


def test_every_block_format_of_the_table_is_tested() -> None:
    assert set(SCALE_FIELDS) == set(BLOCK_WEIGHTS)


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("qtype", list(BLOCK_WEIGHTS), ids=lambda t: t.name)
def test_every_block_format_dequantizes_as_gguf_does_bit_for_bit(
    qtype: QType, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By the native kernel that reads the format (the usual path: an embedding's rows, a dense load), and by
    torch's ops (where the kernels cannot be built); all at once, and a few rows at a time as a large tensor."""
    block = BLOCK_WEIGHTS[qtype]
    rows, cols = 9, 3 * block
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    if path == "torch":
        monkeypatch.setattr(gguf_blocks, "_native_dequantizer", lambda qtype, device: None)
    else:
        assert gguf_blocks._native_dequantizer(qtype, torch.device("cpu")) is not None
    reference = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    for chunk in (gguf_blocks._CHUNK_WEIGHTS, 2 * cols):
        monkeypatch.setattr(gguf_blocks, "_CHUNK_WEIGHTS", chunk)
        ours = GGUFBlocks.from_raw(raw, qtype, (rows, cols)).dequantize()
        assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape == (rows, cols)
        np.testing.assert_array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def test_a_super_block_is_never_split_between_columns() -> None:
    raw = random_blocks(QType.Q4_K, 4, 512, np.random.default_rng(0))
    blocks = GGUFBlocks.from_raw(raw, QType.Q4_K, (4, 512))
    assert blocks.shape == (4, 512) and blocks.block_weights == 256
    assert torch.equal(blocks.narrow(1, 256, 256).dequantize(), blocks.dequantize()[:, 256:])
    assert torch.equal(blocks.narrow(0, 1, 2).dequantize(), blocks.dequantize()[1:3])
    # 32 columns is a block boundary for Q4_0, inside a super-block for Q4_K.
    with pytest.raises(ValueError, match=r"Q4_K tensor can only be split along its columns at multiples of 256"):
        blocks.narrow(1, 32, 256)
    with pytest.raises(ValueError, match="multiples of 256"):
        blocks.narrow(1, 0, 224)
    q4_0 = GGUFBlocks.from_raw(random_blocks(QType.Q4_0, 4, 512, np.random.default_rng(1)), QType.Q4_0, (4, 512))
    assert q4_0.narrow(1, 32, 256).shape == (4, 256)
    with pytest.raises(ValueError, match="whole blocks of 256 weights, not 224"):
        GGUFBlocks.from_raw(raw, QType.Q4_K, (4, 224))


def test_unsupported_tensor_type_is_named_in_the_error(tmp_path: Path) -> None:
    # IQ2_XXS: a real ggml type outside tokenmill's table (66 bytes for 256 weights).
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("matrix", np.zeros((4, 66), dtype=np.uint8), raw_dtype=QType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = open_gguf(path).tensors[0]
    with pytest.raises(GGUFError, match=r"GGUF tensor type IQ2_XXS is not supported \(supported: F32, .*Q4_K.*\)"):
        dequantize_tensor(tensor)


def test_a_tensor_type_ggml_has_no_name_for_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "made-up.gguf"
    _write_tensors(path, {"matrix": (np.zeros((4, 32), dtype=np.float32), QType.F32)})
    data = bytearray(path.read_bytes())
    # The tensor's info: its name, n_dims (u32), the dims (u64 each), then its type (u32).
    at = data.index(b"matrix") + len(b"matrix")
    at += 4 + 8 * int.from_bytes(data[at : at + 4], "little")
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor's type is not one the gguf package knows \(.*99"):
        open_gguf(path)


def llama_cpp_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py, verbatim in torch."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# (rows, n_head, n_head_kv): the converter calls permute(q, n_head, n_head) and permute(k, n_head, n_head_kv).
@pytest.mark.parametrize(
    ("rows", "n_head", "n_head_kv"),
    [(64, 4, 4), (32, 4, 2), (576, 9, 9), (192, 9, 3)],
    ids=["q", "k-gqa", "smollm2-q", "smollm2-k"],
)
def test_unpermute_inverts_llama_cpp_permutation(rows: int, n_head: int, n_head_kv: int) -> None:
    weight = torch.randn(rows, 24)
    bias = torch.randn(rows)
    permuted = llama_cpp_permute(weight, n_head, n_head_kv)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, n_head_kv), weight)
    assert torch.equal(unpermute_qk(llama_cpp_permute(bias, n_head, n_head_kv), n_head_kv), bias)


# --- end to end: a tiny Hugging Face model converted to GGUF the way llama.cpp does -------------

_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Phi-3's fused tensors, as llama.cpp names them (gate and up rows together in ffn_up).
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    # A mixture of experts (transformers 5 holds each layer's experts stacked, gate and up together).
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:])]}"


def llama_cpp_rope_factors(rope: dict[str, float], head_dim: int) -> torch.Tensor:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for Llama 3 RoPE scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old_context = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def convert_hf_to_gguf(
    model: torch.nn.Module,
    arch: str,
    path: Path,
    permute: bool | None = None,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    quantize: Callable[[str], QType] | None = None,
) -> None:
    """A float32 GGUF of a transformers model, with llama.cpp's metadata keys and q/k permutation
    (``permute``: as its converter does for ``arch``, by default only llama); ``metadata`` adds a
    family's own keys. A mixture of experts gets llama.cpp's expert counts and its stacked expert
    tensors (``ffn_gate_exps`` / ``ffn_up_exps`` [experts, width, hidden], ``ffn_down_exps``
    [experts, hidden, width]). ``quantize(gguf name)``: the type a matrix is written in (F32 if None)."""
    permute = arch == "llama" if permute is None else permute
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:  # else the reader's default (Qwen3's usually is not)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(cfg.rope_parameters, head_dim).numpy())
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "norm_topk_prob", None) is not None:
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
    if metadata is not None:
        metadata(writer)
    tied = cfg.tie_word_embeddings
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.detach().float()
        if permute and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif permute and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * width, hidden]: gate rows, then up
            gate, up = data.chunk(2, dim=1)
            layer = name.split(".")[2]
            tensors += [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
        else:
            tensors.append((_gguf_name(name), data))
    for gguf_name, data in tensors:
        qtype = quantize(gguf_name) if quantize is not None and data.dim() > 1 else QType.F32
        if qtype == QType.F32:
            writer.add_tensor(gguf_name, data.contiguous().numpy())
        else:
            writer.add_tensor(gguf_name, _encode(data.contiguous().numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises biases to 0 and norms to 1; random values make every tensor count."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise + 1.0 if "norm" in name else noise * 2)


def _tiny_hf_model(kind: str, tied: bool) -> torch.nn.Module:
    common = dict(  # noqa: C408 - keyword names as in the transformers configs
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=10000.0))
    elif kind == "llama3":
        # Llama 3.1's published scaling; a 16-dim head at theta 10000 has wavelengths in all three bands.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        common["max_position_embeddings"] = 16384  # transformers wants it above the original context
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=10000.0))
    _randomize(model, seed=1)
    return model.eval()


@pytest.mark.parametrize(("kind", "tied"), [("llama", True), ("llama", False), ("llama3", False), ("qwen2", False)])
def test_gguf_converted_model_gives_the_hugging_face_logits(tmp_path: Path, kind: str, tied: bool) -> None:
    hf_model = _tiny_hf_model(kind, tied)
    arch = "qwen2" if kind == "qwen2" else "llama"
    path = tmp_path / f"tiny-{arch}.gguf"
    convert_hf_to_gguf(hf_model, arch, path)

    model = load_model(path)
    assert model.config.tie_word_embeddings is tied
    assert model.config.attention_bias is (arch == "qwen2")
    if tied:
        assert torch.equal(model.lm_head.quant.dequantized(model.lm_head), model.model.embed_tokens.weight)
    if kind == "llama3":
        assert model.config.rope_scaling is not None and model.config.rope_scaling.factor == 8.0

    ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = hf_model(ids[None]).logits[0]
        hidden = forward_prompt(model, ids.tolist())
        actual = model.compute_logits(hidden)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_llama_gguf_stores_q_permuted_and_the_loader_restores_hugging_face_order(tmp_path: Path) -> None:
    # Guards the end-to-end test: the permutation is not a no-op here, so undoing it is what matters.
    hf_model = _tiny_hf_model("llama", tied=False)
    path = tmp_path / "tiny.gguf"
    convert_hf_to_gguf(hf_model, "llama", path)
    q_hf = hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    q_file = dequantize_tensor(next(t for t in open_gguf(path).tensors if t.name == "blk.0.attn_q.weight"))
    _, state = load_gguf(path)
    assert not torch.equal(q_file, q_hf)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], q_hf)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="gpt2"):
        load_gguf(path)


# --- a Q4_K_M-style file: k-quant layers load, dense and exact, through the worker's load path ----

KQ_VOCAB, KQ_HIDDEN, KQ_INTERMEDIATE, KQ_HEADS, KQ_KV_HEADS, KQ_LAYERS = 64, 256, 512, 4, 2, 2
KQ_HEAD_DIM = KQ_HIDDEN // KQ_HEADS


def _kquant_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, QType]]:
    """llama.cpp's Q4_K_M mix: Q4_K, the output head and (here, layer 0's) attn_v and ffn_down in
    Q6_K, float32 norms; random valid blocks, scaled so the weights stay about 0.1."""
    scale = {QType.Q4_K: 1e-4, QType.Q6_K: 3e-5}

    def blocks(qtype: QType, rows: int, cols: int) -> tuple[np.ndarray, QType]:
        return random_blocks(qtype, rows, cols, rng, scale[qtype]), qtype

    def norm() -> tuple[np.ndarray, QType]:
        return (1 + 0.1 * rng.standard_normal(KQ_HIDDEN)).astype(np.float32), QType.F32

    kv = KQ_KV_HEADS * KQ_HEAD_DIM
    tensors = {"token_embd.weight": blocks(QType.Q4_K, KQ_VOCAB, KQ_HIDDEN)}
    for i in range(KQ_LAYERS):
        wide = QType.Q6_K if i == 0 else QType.Q4_K
        tensors |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": blocks(QType.Q4_K, KQ_HIDDEN, KQ_HIDDEN),
            f"blk.{i}.attn_k.weight": blocks(QType.Q4_K, kv, KQ_HIDDEN),
            f"blk.{i}.attn_v.weight": blocks(wide, kv, KQ_HIDDEN),
            f"blk.{i}.attn_output.weight": blocks(QType.Q4_K, KQ_HIDDEN, KQ_HIDDEN),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": blocks(QType.Q4_K, KQ_INTERMEDIATE, KQ_HIDDEN),
            f"blk.{i}.ffn_up.weight": blocks(QType.Q4_K, KQ_INTERMEDIATE, KQ_HIDDEN),
            f"blk.{i}.ffn_down.weight": blocks(wide, KQ_HIDDEN, KQ_INTERMEDIATE),
        }
    return tensors | {"output_norm.weight": norm(), "output.weight": blocks(QType.Q6_K, KQ_VOCAB, KQ_HIDDEN)}


def _write_llama(path: Path, tensors: dict[str, tuple[np.ndarray, QType]]) -> None:
    """A tiny Llama GGUF with llama.cpp's metadata keys; quantized tensors given as their raw bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-q4_k_m")
    writer.add_context_length(128)
    writer.add_embedding_length(KQ_HIDDEN)
    writer.add_block_count(KQ_LAYERS)
    writer.add_feed_forward_length(KQ_INTERMEDIATE)
    writer.add_head_count(KQ_HEADS)
    writer.add_head_count_kv(KQ_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(KQ_HEAD_DIM)
    writer.add_vocab_size(KQ_VOCAB)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype == QType.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def q4_k_m_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The k-quant file, and the same model with every tensor as gguf.quants dequantizes it (float32)."""
    tensors = _kquant_tensors(np.random.default_rng(7))
    folder = tmp_path_factory.mktemp("kquants")
    _write_llama(folder / "tiny-q4_k_m.gguf", tensors)
    dequantized = {
        name: (data if qtype == QType.F32 else gguf.quants.dequantize(data, qtype), QType.F32)
        for name, (data, qtype) in tensors.items()
    }
    _write_llama(folder / "tiny-f32.gguf", dequantized)
    return folder / "tiny-q4_k_m.gguf", folder / "tiny-f32.gguf"


def test_a_q4_k_m_file_dequantized_gives_the_logits_of_its_dequantized_weights(q4_k_m_files: tuple[Path, Path]) -> None:
    """--quantization none --dtype float32: every k-quant layer dense, exactly as gguf dequantizes it (the reference the
    native k-quant kernel is held to, tests/engine/test_kquant_model.py)."""
    kquants, f32 = q4_k_m_files
    types = {t.name: QType(t.tensor_type) for t in open_gguf(kquants).tensors}
    assert {types["output.weight"], types["blk.0.ffn_down.weight"], types["blk.1.attn_q.weight"]} == {
        QType.Q6_K,
        QType.Q4_K,
    }
    model = load(LoadOptions(model=str(kquants), quantization="none", dtype="float32"))
    reference = load(LoadOptions(model=str(f32)))
    plan = model.plan
    assert set(plan.method_counts) == {"none"} and sum(plan.method_counts.values()) == KQ_LAYERS * 4 + 1
    # Both run the same plan, on the same float32 weights: gguf's exact dequantization.
    assert (plan.layers, plan.executor, plan.ops) == (
        reference.plan.layers,
        reference.plan.executor,
        reference.plan.ops,
    )
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ids = torch.randint(0, KQ_VOCAB, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        logits = model.compute_logits(forward_prompt(model, ids))
        expected = reference.compute_logits(forward_prompt(reference, ids))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    # Bitwise: the same weights through the same kernels in the same order.
    assert torch.equal(logits, expected)


def test_a_layer_whose_parts_two_kernels_read_is_dense_and_the_plan_says_why(tmp_path: Path) -> None:
    """Q5_1 (read by the 32-weight block kernels) beside Q4_K (the k-quant kernel) in one packed layer:
    no one kernel reads both, so that layer is dense; a layer wholly in Q5_1 is served natively."""
    rng = np.random.default_rng(11)
    tensors = _kquant_tensors(rng)
    for name, (data, qtype) in list(tensors.items()):
        if name.endswith(("attn_k.weight", "attn_output.weight")):
            tensors[name] = (random_blocks(QType.Q5_1, *_shape_of(data, qtype), rng, 0.01), QType.Q5_1)
    path = tmp_path / "tiny-q5_1.gguf"
    _write_llama(path, tensors)
    plan = resolve_plan(LoadOptions(model=str(path)), open_checkpoint(path), DeviceFacts())
    assert plan.layers["model.layers.1.self_attn.qkv_proj"].method == "none"
    assert plan.layers["model.layers.1.self_attn.o_proj"].method == "gguf-vnni"
    assert plan.layers["model.layers.1.mlp.down_proj"].method == "gguf-kquant"
    assert "Q4_K/Q5_1 tensors, dense (exactly dequantized): stored in mixed formats" in plan.quant_reasons["none"]


def _shape_of(data: np.ndarray, qtype: QType) -> tuple[int, int]:
    weights, size = gguf.GGML_QUANT_SIZES[qtype]
    return data.shape[0], data.shape[1] // size * weights


def test_a_q4_k_m_file_refuses_a_tensor_parallel_degree_that_splits_a_super_block(
    q4_k_m_files: tuple[Path, Path],
) -> None:
    kquants, f32 = q4_k_m_files
    # 4 heads of 64 over 2 ranks: 128 inputs of o_proj per rank, half a Q4_K super-block.
    with pytest.raises(PlanRefused, match=r"o_proj \(128\).*multiples of 256.*Q4_K blocks of 256 weights.*work: 1$"):
        resolve_plan(LoadOptions(model=str(kquants), tensor_parallel=2), open_checkpoint(kquants), DeviceFacts())
    assert read_dims(kquants).block == 256 and read_dims(kquants).block_format == "Q4_K"
    # The same model in float32 splits anywhere the heads do.
    resolve_plan(LoadOptions(model=str(f32), tensor_parallel=2), open_checkpoint(f32), DeviceFacts())
    with pytest.raises(ValueError, match="multiples of 256"):
        check_degree(read_dims(kquants), 2)

"""The tokenizer: byte-level BPE on tiktoken or SentencePiece on Hugging Face tokenizers, read from a GGUF file
or a Hugging Face tokenizer directory.

tokenizer.py (the Tokenizer the engine and the service use: encode, decode, chat) · byte_level.py
(the tiktoken encoding: pre-tokenizer patterns, byte alphabet, rank table) · sentencepiece.py (the
SentencePiece encoding: a GGUF's "llama" vocabulary as BPE over its scores, or a tokenizer.json as
written) · gguf.py (read from a GGUF's metadata, the kind chosen by tokenizer.ggml.model) · hf.py
(read from a Hugging Face directory) · load.py (which reader for a path).
"""

from tokenmill_service.contract.tokenizer.byte_level import (
    GPT2_DIGIT_RUNS_PATTERN,
    GPT2_INDIVIDUAL_DIGITS_PATTERN,
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    build_bpe_encoding,
)
from tokenmill_service.contract.tokenizer.gguf import GGUF_PRE_PATTERNS, tokenizer_from_gguf
from tokenmill_service.contract.tokenizer.hf import tokenizer_from_hf_dir
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.contract.tokenizer.tokenizer import END_OF_TURN_TOKENS, Encoding, Tokenizer, TokenizerError

__all__ = [
    "END_OF_TURN_TOKENS",
    "GGUF_PRE_PATTERNS",
    "GPT2_DIGIT_RUNS_PATTERN",
    "GPT2_INDIVIDUAL_DIGITS_PATTERN",
    "GPT2_PATTERN",
    "LLAMA3_PATTERN",
    "QWEN2_PATTERN",
    "Encoding",
    "Tokenizer",
    "TokenizerError",
    "build_bpe_encoding",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "tokenizer_from_hf_dir",
]

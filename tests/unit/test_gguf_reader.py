"""Opening a GGUF (contract/gguf_reader.py) reads every metadata field as gguf's own reader does, in one
pass over each array rather than numpy calls per element (a Llama 3 vocabulary took seconds)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tokenmill_service.contract.gguf_reader import open_gguf


def _write(path: Path, vocab: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny ✓")
    writer.add_uint32("llama.context_length", 4096)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["", "a", " é", "🦙", *(f"t{i}" for i in range(vocab))])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1, 4, *([1] * vocab)])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 0.0, 2.0, *([-3.5] * vocab)])
    writer.add_array("flags", [True, False, True])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_field_and_tensor_reads_as_ggufs_own_reader_gives_them(tmp_path: Path) -> None:
    path = tmp_path / "fields.gguf"
    _write(path, 200)
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            for i in (0, 2, len(field.data) - 1):
                assert ours.fields[key].contents(i) == field.contents(i), (key, i)
            assert ours.fields[key].contents(slice(1, 3)) == field.contents(slice(1, 3)), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:4] == ["", "a", " é", "🦙"]
    assert [(t.name, t.n_bytes, t.data_offset) for t in ours.tensors] == [
        (t.name, t.n_bytes, t.data_offset) for t in theirs.tensors
    ]
    np.testing.assert_array_equal(ours.tensors[0].data, theirs.tensors[0].data)

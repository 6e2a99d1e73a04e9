"""Our fast GGUF header reader agrees with the ``gguf`` package's reader on the real file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.gguf_file import GGUFFile


def test_metadata_and_tensors_equal_gguf_reader(smollm2_gguf: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    ours = GGUFFile(smollm2_gguf)
    reference = GGUFReader(str(smollm2_gguf))
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for key, field in reference.fields.items():
        if key.startswith("GGUF.") or key not in ours.metadata:
            continue
        if ours.metadata[key] is None:  # long arrays (vocabulary, merges) are skipped
            assert len(field.data) > 64, key
        else:
            assert ours.metadata[key] == field.contents(), key
    # One tensor of each storage type: Q8_0 embedding, Q4_1 projection, F32 norm.
    for t in (reference.tensors[0], reference.tensors[2], reference.tensors[1]):
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        expected = dequantize(t.data, t.tensor_type)
        assert np.array_equal(ours.load(t.name), expected), t.name


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFFile(bogus)


def test_truncated_gguf_file_is_a_clear_error(smollm2_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[:5000])  # ends inside the vocabulary
    with pytest.raises(ValueError, match="truncated or corrupt"):
        GGUFFile(cut)

"""Tensor files carry a hash of their contents; a changed byte is refused, not loaded."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.tensorfile import load_tensors, save_tensors


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(16, 8, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
            "steps": torch.arange(3)}


def test_round_trip_and_every_flipped_data_byte_is_caught(tmp_path):
    f = tmp_path / "m.safetensors"
    save_tensors(f, _state(), metadata={"kind": "test"})
    back = load_tensors(f)
    assert set(back) == set(_state()) and all(torch.equal(back[k], v) for k, v in _state().items())
    raw = f.read_bytes()
    header_len = 8 + int.from_bytes(raw[:8], "little")
    for pos in (header_len, header_len + 200, len(raw) - 1):  # first, middle and last data byte
        bad = bytearray(raw)
        bad[pos] ^= 0x10
        f.write_bytes(bytes(bad))
        with pytest.raises(DraftsmithError, match="content hash"):
            load_tensors(f)
    f.write_bytes(raw[:-7])  # truncated
    with pytest.raises(DraftsmithError, match="damaged"):
        load_tensors(f)


def test_files_without_a_hash_still_load(tmp_path):
    f = tmp_path / "plain.safetensors"
    save_file(_state(), str(f))
    assert torch.equal(load_tensors(f)["a.weight"], _state()["a.weight"])
    with pytest.raises(DraftsmithError, match="does not exist"):
        load_tensors(tmp_path / "missing.safetensors")

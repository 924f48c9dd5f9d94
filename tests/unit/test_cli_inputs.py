"""Bad input files and flags of generate / serve through the CLI's main (in this process:
test_cli.py runs the real process for the same contract): one line on stderr and exit code 2,
never a traceback (cases a tester found giving tracebacks)."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from test_cli import _one_line_error  # noqa: E402  (tests/unit: the same contract, read the same way)


@pytest.fixture
def _run(capsys):
    def run(*args: str) -> SimpleNamespace:
        code = main(list(args))
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)
    return run




@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return str(tiny_model_dir("llama", seed=0))


@pytest.mark.parametrize("messages, needle", [
    ([5], "'messages' must be a non-empty list"),
    ([{"role": "user"}], "'messages' must be a non-empty list"),
    ([], "'messages' must be a non-empty list"),
    ([{"role": "user", "content": {"a": 1}}], "'messages' must be a non-empty list"),
    ([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}], None),  # the template's own verdict
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": "1"}], None),  # (OpenAI's shape of a call: content null)
])
def test_prompt_file_messages_of_the_wrong_shape(_run, tiny, tmp_path, messages, needle):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": messages}) + "\n")
    proc = _run("generate", "--target", tiny, "--prompt-file", str(f), "--max-tokens", "2")
    if needle is None:  # a shape the template may take or refuse: never a traceback
        assert "Traceback" not in proc.stderr and proc.returncode in (0, 2), proc.stderr[-2000:]
        return
    _one_line_error(proc, f"{f}:1:", needle)


def test_binary_and_deeply_nested_files(_run, tiny, tmp_path):
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage")
    for flag in ("--speculative-config", "--json-schema"):
        _one_line_error(_run("generate", "--target", tiny, "--prompt", "x", flag, str(binary)), "is not UTF-8 text")
    _one_line_error(_run("generate", "--target", tiny, "--prompt", "x", "--grammar", str(binary)), "is not UTF-8 text")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 5000 + "\n")
    _one_line_error(_run("generate", "--target", tiny, "--prompt-file", str(deep)), "nested too deeply")
    schema = tmp_path / "deep.json"
    schema.write_text('{"a":' * 5000 + "1" + "}" * 5000)
    _one_line_error(_run("generate", "--target", tiny, "--prompt", "x", "--json-schema", str(schema)),
                    "json must be a JSON schema")


def test_a_device_that_does_not_exist(_run, tiny):
    _one_line_error(_run("generate", "--target", tiny, "--prompt", "x", "--device", "banana"),
                    "unknown device 'banana'")


def test_serve_on_an_address_it_cannot_listen_on_stops_before_the_model_loads(_run, tiny):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        _one_line_error(_run("serve", tiny, "--port", str(port)), f"cannot listen on 127.0.0.1:{port}")
    _one_line_error(_run("serve", tiny, "--host", "999.1.1.1"), "is not an address of this machine")


def test_serve_refuses_a_bad_generation_config_before_the_model_loads(_run, tmp_path, monkeypatch):
    """--generation-config DIR without the file, a non-object --override-generation-config, an
    unknown or mistyped field: one line, before anything loads (the target named here does not
    exist: had it been reached, the error would name it instead)."""
    import draftsmith.api

    monkeypatch.setattr(draftsmith.api, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    serve = ["serve", "no-such-target", "--port", "0"]
    _one_line_error(_run(*serve, "--generation-config", str(tmp_path / "gone")), "not a directory")
    _one_line_error(_run(*serve, "--generation-config", str(tmp_path)), "generation_config.json does not exist")
    _one_line_error(_run(*serve, "--override-generation-config", "[1]"), "is not a JSON object")
    _one_line_error(_run(*serve, "--override-generation-config", '{"temprature": 0.5}'),
                    "temprature is not a sampling default")
    _one_line_error(_run(*serve, "--override-generation-config", '{"top_p": "high"}'), "top_p must be a number")
    seen = {}

    def fake_llm(*a, **kw):
        seen.update(kw)
        raise DraftsmithError("stop here")

    monkeypatch.setattr(draftsmith.api, "LLM", fake_llm)
    _one_line_error(_run(*serve, "--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}'),
                    "stop here")
    assert seen["generation_config"] == "vllm" and seen["override_generation_config"] == {"top_k": 5}


def test_a_drafter_directory_given_as_the_target(_run):
    from draftsmith.drafters.builtin import resolve

    _one_line_error(_run("generate", "--target", resolve("dspark", "smollm2-135m"), "--prompt", "x"),
                    "holds a dspark drafter, not a target model", "--drafter dspark:DIR")


def test_deep_json_in_a_config_file_and_long_schema_text(_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("[" * 5000)
    _one_line_error(_run("export", "--drafter", f"dspark:{ckpt}", "--format", "speculators", "--out",
                         str(tmp_path / "o")), "nested too deeply")
    _one_line_error(_run("bench", "--json-schema", "[" * 5000, "--out", str(tmp_path / "b")), "no such file")


def test_a_cgroup_limit_bounds_the_free_memory(monkeypatch):
    """In a memory-limited container MemAvailable is the host's: the cgroup's limit minus its
    usage (page cache it may reclaim counted as free) is what a KV cache may take."""
    import builtins
    import io

    from draftsmith.models import kv_cache

    files = {"/proc/meminfo": "MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n",
             "/sys/fs/cgroup/memory.max": "8589934592\n", "/sys/fs/cgroup/memory.current": "6442450944\n",
             "/sys/fs/cgroup/memory.stat": "anon 1\ninactive_file 1073741824\n"}
    real = builtins.open

    def fake(path, *a, **kw):
        if str(path) in files:
            return io.StringIO(files[str(path)])
        if str(path).startswith(("/sys/fs/cgroup", "/proc/meminfo")):
            raise FileNotFoundError(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake)
    assert kv_cache.free_memory("cpu") == 8589934592 - 6442450944 + 1073741824  # 3 GiB, not the host's 47.7
    files["/sys/fs/cgroup/memory.max"] = "max\n"  # (no limit: the host's MemAvailable)
    assert kv_cache.free_memory("cpu") == 50000000 * 1024


def test_draftsmiths_own_warnings_are_one_line_on_the_cli(tmp_path, capsys, monkeypatch):
    """A DraftsmithWarning (e.g. bfloat16 on a CPU without hardware bf16) prints as one
    `draftsmith: warning:` line, not Python's UserWarning with its source line; other warnings
    keep Python's form; Python's warning display is restored after the job."""
    import warnings

    import draftsmith.models.threads as threads
    from draftsmith.cli import main
    from draftsmith.errors import DraftsmithWarning

    def configure(n):
        warnings.warn("bfloat16 is emulated here; use --dtype float32", DraftsmithWarning, stacklevel=2)
        warnings.warn("some library's own", DeprecationWarning, stacklevel=2)

    monkeypatch.setattr(threads, "configure_threads", configure)
    shown = warnings.showwarning
    with pytest.warns(DeprecationWarning, match="some library's own") as seen:  # (passed on as Python's)
        assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    assert [w.category for w in seen] == [DeprecationWarning]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "draftsmith: warning: bfloat16 is emulated here; use --dtype float32", err
    assert len(err) == 2 and err[1].startswith("draftsmith: error:") and warnings.showwarning is shown


def test_a_prompt_file_that_is_a_directory_or_named_in_capitals(tmp_path):
    """generate --prompt-file DIR said the file did not exist; PROMPTS.JSONL was read as a text
    file, each JSON line sent to the model as a prompt of its own (eval and regen read it as JSONL)."""
    from draftsmith.cli.generate import read_prompts

    with pytest.raises(DraftsmithError, match="is a directory; give a .txt file"):
        read_prompts(SimpleNamespace(prompt=[], prompt_file=tmp_path))
    f = tmp_path / "PROMPTS.JSONL"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert read_prompts(SimpleNamespace(prompt=[], prompt_file=f)) == ["hi"]

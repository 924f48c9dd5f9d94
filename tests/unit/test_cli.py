"""User errors through the real CLI process: exit code 2 and one line on stderr, no traceback."""

from __future__ import annotations

import argparse
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


def test_structured_output_flags(tiny, tmp_path, capsys):
    """--choice / --regex / --json-schema (file or text) constrain the output; a grammar that
    does not compile or a missing schema file is one line. (Compact JSON: with any whitespace
    allowed, vLLM's default, this random model spends its tokens on it.)"""
    from draftsmith.cli import main

    base = ["generate", "--target", str(tiny), "--prompt", "ab", "--max-tokens", "24", "--json"]
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}')
    for flags, check in ((["--choice", "left", "--choice", "right"], lambda t: t in ("left", "right")),
                         (["--regex", "[xyz]{4}"], lambda t: len(t) == 4 and set(t) <= set("xyz")),
                         (["--json-schema", str(schema), "--no-json-whitespace"],
                          lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
                         (["--json-schema", schema.read_text(), "--no-json-whitespace"],
                          lambda t: json.loads(t) in ({"ok": True}, {"ok": False}) and " " not in t)):
        assert main(base + flags) == 0
        (res,) = json.loads(capsys.readouterr().out)["results"]
        assert res["finish_reason"] == "stop" and check(res["text"]), (flags, res["text"])
    _one_line_error(_run(*base, "--regex", "(("), "regex does not compile", "unclosed group")
    _one_line_error(_run(*base, "--json-schema", str(tmp_path / "none.json")), "--json-schema", "no such file")


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


# ---- the parser itself: version, option names, help ------------------------------------------------

PIPELINE = ["regen", "cache", "train", "calibrate", "eval", "bench", "generate", "serve", "export", "import", "profile"]


def _job_parsers() -> dict:
    from draftsmith.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices


def test_version(capsys):
    import draftsmith
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"draftsmith {draftsmith.__version__}"


@pytest.mark.parametrize("job, required, dest", [
    ("generate", [], "max_new_tokens"),
    ("regen", [], "max_new_tokens"),
    ("eval", ["--drafter", "ngram"], "max_new_tokens"),
    ("calibrate", ["--drafter", "dspark:x", "--tasks", "humaneval"], "max_new_tokens"),
    ("bench", [], "max_tokens"),
])
def test_max_tokens_and_its_alias(job, required, dest):
    """`--max-tokens` on every job with a new-token limit; `--max-new-tokens` still works, same dest."""
    from draftsmith.cli import build_parser

    for flag in ("--max-tokens", "--max-new-tokens"):
        args = build_parser().parse_args([job, *required, flag, "7"])
        assert getattr(args, dest) == 7, (job, flag)
    help_text = _job_parsers()[job].format_help()
    assert "--max-tokens N, --max-new-tokens N" in help_text


def test_every_job_help_shows_defaults():
    from draftsmith.cli.options import HelpFormatter

    jobs = _job_parsers()
    for name, parser in jobs.items():
        fmt = HelpFormatter(prog=name)
        for action in parser._actions:
            d = action.default
            if not action.option_strings or d in (None, False, [], argparse.SUPPRESS):
                continue
            assert "default" in fmt._get_help_string(action).lower(), (name, action.option_strings)
        assert "example:\n  draftsmith " + name in parser.format_help(), name
    generate = " ".join(jobs["generate"].format_help().split())
    assert "--max-len MAX_LEN, --max-model-len MAX_LEN context limit per prompt (prompt + output) (default: 2048)" \
        in generate
    assert "(default: none)" in generate and "(default: auto)" in generate  # --drafter, --policy


def test_top_level_help_lists_jobs_in_pipeline_order():
    from draftsmith.cli import build_parser

    assert list(_job_parsers()) == PIPELINE
    text = build_parser().format_help()
    jobs_section = text.split("jobs (in pipeline order):", 1)[1].split("examples:", 1)[0]
    listed = [ln.split()[0] for ln in jobs_section.splitlines() if ln.startswith("    ") and ln.split()[0] in PIPELINE]
    assert listed == PIPELINE
    examples = text.split("examples:", 1)[1]
    at = [examples.index(f"draftsmith {job} ") for job in PIPELINE]  # one example command per job, in order
    assert at == sorted(at)


def test_entry_points_and_module_sizes():
    """`draftsmith` (pyproject), `python -m draftsmith` and `python -m draftsmith.cli` reach the same main."""
    import tomllib
    from pathlib import Path

    import draftsmith.cli as cli

    root = Path(__file__).resolve().parents[2]
    script = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["draftsmith"]
    module, _, attr = script.partition(":")
    assert (module, attr) == ("draftsmith.cli", "main") and cli.main is cli.__dict__[attr]
    for m in ("draftsmith/__main__.py", "draftsmith/cli/__main__.py"):
        assert "from draftsmith.cli import main" in (root / "src" / m).read_text()
    for f in (root / "src/draftsmith/cli").glob("*.py"):
        assert len(f.read_text().splitlines()) <= 450, f
    assert not (root / "src/draftsmith/cli.py").exists()


def test_bad_flag_is_one_usage_error():
    proc = _run("generate", "--max-tokens", "0")
    assert proc.returncode == 2 and "must be a positive integer" in proc.stderr


def test_reproducible_seeds_flag_reaches_the_engine(tiny_model_dir, monkeypatch, capsys):
    """generate / serve: --no-reproducible-seeds switches seeded requests to the rejection rule."""
    import draftsmith.api as api
    from draftsmith.cli import build_parser, main

    seen = []
    real = api.LLM.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("reproducible_seeds"))
        real(self, *a, **kw)

    monkeypatch.setattr(api.LLM, "__init__", spy)
    target = str(tiny_model_dir("llama", seed=0))
    for flag, want in (([], True), (["--no-reproducible-seeds"], False)):
        assert main(["generate", "--target", target, "--prompt", "ab", "--max-tokens", "2", "--seed", "1",
                     "--temperature", "1", *flag]) == 0
        assert seen[-1] is want
    assert build_parser().parse_args(["serve", "--no-reproducible-seeds"]).reproducible_seeds is False


def test_forced_drafts_flag_reaches_the_engine(tiny_model_dir, capsys):
    """generate / serve --forced-drafts N: the engine's cap on a grammar's forced drafts (0: off);
    a negative one is a usage error."""
    from draftsmith.cli import build_parser, main

    target = str(tiny_model_dir("llama", seed=0))
    for flag, forced in (([], True), (["--forced-drafts", "0"], False)):
        assert main(["generate", "--target", target, "--prompt", "ab", "--max-tokens", "8", "--regex", "ab(cdef)+",
                     "--json", *flag]) == 0
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
        assert (json.loads(line)["stats"]["forced_proposed"] > 0) is forced, line
    assert build_parser().parse_args(["serve", "--forced-drafts", "4"]).forced_drafts == 4
    proc = _run("serve", "--forced-drafts", "-1")
    assert proc.returncode == 2 and "must be an integer >= 0" in proc.stderr


def test_serve_takes_the_model_as_vllm_serve_does(monkeypatch):
    """`draftsmith serve MODEL` (vLLM's form) or --target, smollm2-135m by default; both, naming
    two different targets, is a one-line error."""
    from draftsmith import api
    from draftsmith.cli import main

    seen = []

    class Stop(Exception):
        pass

    def spy(self, target, *a, **kw):
        seen.append(target)
        raise Stop

    monkeypatch.setattr(api.LLM, "__init__", spy)
    for argv, want in ((["serve", "m1"], "m1"), (["serve", "--target", "m2"], "m2"), (["serve"], "smollm2-135m"),
                       (["serve", "m3", "--target", "m3"], "m3")):
        with pytest.raises(Stop):
            main(argv)
        assert seen[-1] == want, argv
    _one_line_error(_run("serve", "a", "--target", "b"), "the target is given twice: 'a' and --target 'b'")


def test_bench_json_schema_flag_reads_a_file_or_text_and_says_what_is_wrong(tmp_path):
    """bench --json-schema FILE|JSON: a missing file and text that is not a schema are one-line errors."""
    _one_line_error(_run("bench", "--json-schema", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")),
                    "--json-schema", "no such file")
    _one_line_error(_run("bench", "--json-schema", "{not json", "--out", str(tmp_path / "o")),
                    "--json-schema is not JSON")


def test_vllms_names_for_the_batch_and_context_limits():
    """serve / generate take vLLM's --max-num-seqs and --max-model-len for --max-batch / --max-len."""
    from draftsmith.cli import build_parser

    for job in (["serve", "m"], ["generate", "--prompt", "x"]):
        a = build_parser().parse_args([*job, "--max-model-len", "512", "--max-num-seqs", "4"])
        assert (a.max_len, a.max_batch) == (512, 4)
        a = build_parser().parse_args(job)
        assert (a.max_len, a.max_batch) == (2048, 8)


def test_a_kv_cache_that_cannot_fit_is_refused_with_the_numbers(tiny_model_dir):
    """--max-batch / --max-len past the free memory: one line with the size, before allocating
    (it was an out-of-memory kill of the process); K past 64 is a usage error on every job."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.kv_cache import KVCache, free_memory

    free = free_memory("cpu")
    if free is None:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(DraftsmithError, match=r"needs \d+\.\d GiB; cpu memory has \d+\.\d GiB free: lower --max-batch "
                       r"or --max-len \(regen: --batch-size or --max-len; profile: --max-batch or --context-len"):
        KVCache(num_layers=30, max_rows=10**6, num_kv_heads=3, max_len=2048, head_dim=64)
    _one_line_error(_run("generate", "--target", str(tiny_model_dir("llama", seed=0)), "--prompt", "x",
                         "--max-batch", "100000000"), "lower --max-batch or --max-len")
    for job in (["generate", "--prompt", "x"], ["serve"], ["profile"]):
        proc = _run(*job, "-k", "65")
        assert proc.returncode == 2 and "must be an integer in" in proc.stderr, proc.stderr[-500:]


def test_an_out_of_the_wrong_kind_is_one_line_before_any_work(tiny, tmp_path, capsys):
    """--out naming a file where a job writes a directory (cache, eval, bench, export, import,
    train's out), a directory where it writes a file (regen, with --resume / --overwrite too) or
    a path under a file: one line naming it (they were IsADirectoryError, NotADirectoryError or
    FileExistsError tracebacks, eval's after the target had loaded); nothing is touched."""
    from draftsmith.cli import main

    a_file, a_dir, ckpt = tmp_path / "a-file", tmp_path / "a-dir", tmp_path / "ckpt"
    a_file.write_text("kept")
    a_dir.mkdir()
    (a_dir / "x").write_text("kept")
    ckpt.mkdir()
    (tmp_path / "m.jsonl").write_text('{"prompt": "hi"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny}\nout: {a_file}\ndrafter: {{kind: dspark, layer_ids: [0, 2], qk_norm: true}}\n"
                      f"data: {{cache: {tmp_path / 'cache'}}}\n")
    t = ["--target", str(tiny)]
    is_file, is_dir = "is a file, but this job writes a directory there", "is a directory, but this job writes a file"
    regen = ["regen", *t, "--mix", str(tmp_path / "m.jsonl"), "--out", str(a_dir)]
    for argv, needle in (
        (regen, is_dir), ([*regen, "--overwrite"], is_dir), ([*regen, "--resume"], is_dir),
        (["regen", *t, "--mix", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "r.jsonl"),
          "--features-out", str(a_file)], f"--features-out {a_file} {is_file}"),
        (["cache", *t, "--data", str(tmp_path / "m.jsonl"), "--out", str(a_file)], f"--out {a_file} {is_file}"),
        (["cache", *t, "--data", str(tmp_path / "m.jsonl"), "--out", str(a_file / "sub")],
         f"{a_file} is a file, not a directory"),
        (["eval", *t, "--drafter", "ngram", "--out", str(a_file)], is_file),
        (["bench", *t, "--out", str(a_file)], is_file),
        (["export", *t, "--drafter", f"dspark:{ckpt}", "--format", "speculators", "--out", str(a_file)], is_file),
        (["import", str(ckpt), "--format", "speculators", *t, "--out", str(a_file)], is_file),
        (["train", "--config", str(recipe)], f"the run directory (out) {a_file} {is_file}"),
    ):
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("draftsmith: error:") and needle in lines[0], (argv, lines)
    assert a_file.read_text() == "kept" and [p.name for p in a_dir.iterdir()] == ["x"]
    assert not (tmp_path / "r.jsonl").exists() and not any(ckpt.iterdir())


def test_sigterm_is_an_interrupt_while_a_job_runs_and_restored_after():
    """SIGTERM raises Terminated (a KeyboardInterrupt: the jobs' Ctrl-C paths run) while any job
    but serve runs (uvicorn shuts down on its own); the process's handler is put back after."""
    import signal

    from draftsmith.cli import Terminated, _sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with _sigterm_as_interrupt("regen"):
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    with _sigterm_as_interrupt("serve"):
        assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Terminated, KeyboardInterrupt)

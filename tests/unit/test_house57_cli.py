"""`draftsmith import` checks --out before its source, as `draftsmith export` does: a bad --out
(a file, a directory that holds something, a built-in drafter's package directory) is the same
one-line error from both, whatever is wrong with the source, and nothing is written. import
used to read the source first, so one mistake got two different errors from the two commands.

No target is needed: every refusal here comes before it loads (--target names nothing, so a
check that slipped after the load would be another error, not a slow test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.cli import main


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None: a directory), to show nothing was written."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _bad_sources(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Sources import refuses (with a good --out), each with what it says about it."""
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{not json")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text(json.dumps({"kind": "dspark", "target_id": "t", "target_weights_hash": "h",
                                                  "format_version": 1}))
    return {"missing": (tmp_path / "nowhere", "does not exist"),
            "a file": (unknown / "config.json", "is a file, not a drafter directory"),
            "unknown format": (unknown, "cannot tell the format"),
            "damaged": (damaged, "not valid JSON"),
            "already ours": (ours, "already a Draftsmith checkpoint")}


def _bad_outs(tmp_path: Path, monkeypatch) -> dict[str, tuple[Path, list[str], str]]:
    """--out values export and import refuse: (path, extra flags, what the error says)."""
    from draftsmith.drafters import builtin

    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    cache = tmp_path / "cache"  # another job's directory (a feature cache)
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    run = tmp_path / "run"  # a training run
    run.mkdir()
    (run / "train_info.json").write_text("{}")
    monkeypatch.setattr(builtin, "BUILTIN_ROOT", tmp_path / "package")
    shipped = tmp_path / "package" / "dspark" / "shipped"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("the package's config")
    return {"a file": (a_file, [], f"--out {a_file} is a file, but this job writes a directory there"),
            "under a file": (a_file / "sub", [], f"{a_file} is a file, not a directory"),
            "another job's": (cache, [], f"{cache} is not empty; give a new --out, or pass --overwrite"),
            "exists, no --overwrite": (run, [], f"{run} is not empty; give a new --out, or pass --overwrite"),
            "built-in": (shipped, ["--overwrite"], f"--out {shipped} is inside Draftsmith's built-in drafters"),
            "built-in, new": (shipped.parent / "new", [], "is inside Draftsmith's built-in drafters")}


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error:"), (argv, lines)
    return lines[0]


def test_import_reports_a_bad_out_before_a_bad_source_as_export_does(tmp_path, monkeypatch, capsys):
    target = ["--target", str(tmp_path / "no-target")]
    sources, outs = _bad_sources(tmp_path), _bad_outs(tmp_path, monkeypatch)
    before = _tree(tmp_path)
    for name, (src, says) in sources.items():  # each source is bad on its own: a good --out reaches it
        assert says in _error(["import", str(src), *target, "--out", str(tmp_path / "new")], capsys), name
    not_a_checkpoint = tmp_path / "unknown"  # export's bad source: a directory that is no checkpoint
    assert "no 'kind'" in _error(["export", *target, "--drafter", f"dspark:{not_a_checkpoint}", "--format",
                                  "speculators", "--out", str(tmp_path / "new")], capsys)
    for out_name, (out, flags, says) in outs.items():
        exported = _error(["export", *target, "--drafter", f"dspark:{not_a_checkpoint}", "--format", "speculators",
                           "--out", str(out), *flags], capsys)
        assert says in exported, (out_name, exported)
        for src_name, (src, _) in sources.items():
            for spelling in ([str(src)], ["--src", str(src)]):
                imported = _error(["import", *spelling, *target, "--out", str(out), *flags], capsys)
                assert imported == exported, (out_name, src_name, imported, exported)
    assert _tree(tmp_path) == before
    assert not (tmp_path / "new").exists()


def test_an_out_that_is_the_bad_source_itself_is_reported_as_the_out(tmp_path, capsys):
    """import DIR --out DIR, DIR being of no format import reads: the --out error (export's for
    --out = its checkpoint), not the format's; with --overwrite, the source's."""
    src = _bad_sources(tmp_path)["unknown format"][0]
    before = _tree(tmp_path)
    argv = ["import", str(src), "--target", str(tmp_path / "no-target"), "--out", str(src)]
    assert f"--out {src} is the drafter directory being read" in _error(argv, capsys)
    assert "cannot tell the format" in _error([*argv, "--overwrite"], capsys)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("flag", [[], ["--overwrite"]])
def test_import_checks_its_arguments_before_out(tmp_path, capsys, flag):
    """What the command line itself gets wrong (two different source directories) still comes
    first, as export's --drafter spec does: it is no statement about --out."""
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    argv = ["import", str(tmp_path / "a"), "--src", str(tmp_path / "b"), "--out", str(a_file), *flag]
    assert "two source directories" in _error(argv, capsys)
    assert a_file.read_text() == "kept"

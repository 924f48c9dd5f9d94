"""--threads (every job) and train.threads past the machine's CPUs, found by hunt 55: torch took
100000 and the process died of a segmentation fault in its thread pool (exit 139, no message)."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("job", [["profile"], ["regen"], ["train", "--config", "r.yaml"], ["bench"]])
def test_threads_past_the_cpus_is_a_usage_error(job, capsys, monkeypatch):
    import draftsmith.models.threads as threads_mod
    from draftsmith.cli import main

    def past_parsing(n):  # the job would run now (set torch's threads, then load the target)
        raise AssertionError(f"--threads {n} was accepted")

    monkeypatch.setattr(threads_mod, "configure_threads", past_parsing)
    cpus = os.cpu_count() or 1
    with pytest.raises(SystemExit) as e:
        main([*job, "--threads", str(cpus + 1)])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"argument --threads: must be at most the {cpus} CPUs of this machine, got {cpus + 1}")


def test_train_threads_past_the_cpus_is_refused():
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.config import parse_config

    from standin_drafter import CATALOGUE

    raw = {"out": "runs/x", "drafter": {"kind": "head", "layer_ids": [0]}, "data": {"cache": "c"},
           "train": {"threads": 100000}}
    with pytest.raises(DraftsmithError, match=r"train\.threads: Input should be less than or equal to"):
        parse_config(raw, CATALOGUE)
    raw["train"]["threads"] = os.cpu_count() or 1
    assert parse_config(raw, CATALOGUE).train.threads == raw["train"]["threads"]

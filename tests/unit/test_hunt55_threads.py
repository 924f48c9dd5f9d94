"""--threads (every job), train.threads and LLM(threads=...) past the machine's CPUs, found by
hunt 55: torch took 100000 and the process died of a segmentation fault in its thread pool (exit
139, no message). Now the CPU count is used, with a one-line warning: a command written for a
bigger machine still runs."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from draftsmith.errors import DraftsmithWarning


@pytest.mark.parametrize("job", [["profile"], ["regen"], ["train", "--config", "r.yaml"], ["bench"]])
def test_threads_past_the_cpus_run_on_the_cpus_with_a_warning(job, capsys, monkeypatch):
    from draftsmith.cli import main

    seen = []

    def stop_before_work(args):  # the job would start now: torch's threads are already set
        seen.append(torch.get_num_threads())
        return 0

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("argparse.ArgumentParser.parse_args", _with_func(stop_before_work))
        assert main([*job, "--threads", "100000"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [cpus]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"draftsmith: warning: 100000 threads asked for, but this process may use {cpus} CPUs; using {cpus}"]


def _with_func(func):
    import argparse

    real = argparse.ArgumentParser.parse_args

    def parse(self, *a, **kw):
        args = real(self, *a, **kw)
        args.func = func
        return args

    return parse


def test_llm_threads_and_train_threads_past_the_cpus(tiny_model_dir):
    from draftsmith import LLM
    from draftsmith.models.threads import within_cpus

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        with pytest.warns(DraftsmithWarning, match=f"this process may use {cpus} CPUs; using {cpus}"):
            LLM(str(tiny_model_dir("llama", seed=0)), threads=100000, max_len=32)
        assert torch.get_num_threads() == cpus
    finally:
        torch.set_num_threads(before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert within_cpus(cpus) == cpus and within_cpus(1) == 1
    with pytest.warns(DraftsmithWarning):
        assert within_cpus(cpus + 1) == cpus


def test_train_threads_past_the_cpus_are_taken():
    from draftsmith.train.config import parse_config

    from standin_drafter import CATALOGUE

    raw = {"out": "runs/x", "drafter": {"kind": "head", "layer_ids": [0]}, "data": {"cache": "c"},
           "train": {"threads": 100000}}
    assert parse_config(raw, CATALOGUE).train.threads == 100000  # (the trainer uses within_cpus)

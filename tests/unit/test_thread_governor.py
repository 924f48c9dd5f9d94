"""ThreadGovernor (models/threads.py): fewer torch threads while other processes keep cores busy."""

from __future__ import annotations

import pytest

from draftsmith import LLM
from draftsmith.engine.builder import build_engine
from draftsmith.models.threads import CpuSample, ThreadGovernor, read_cpu, threads_beside


def test_threads_beside_rounds_the_free_cores_with_a_dead_band():
    assert [threads_beside(2, o, 2, 0.7) for o in (0.0, 0.6, 0.8, 1.0, 2.0)] == [2, 2, 1, 1, 1]
    assert [threads_beside(2, o, 1, 0.7) for o in (0.0, 0.2, 0.4, 1.0)] == [2, 2, 1, 1]
    assert threads_beside(16, 5.2, 16, 0.7) == 11 and threads_beside(16, 40.0, 16, 0.7) == 1


class FakeClock:
    """CPU samples the test writes: `others` cores busy elsewhere, `mine` cores of this process."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 100.0, 0.0, 0.0

    def advance(self, seconds: float, others: float, mine: float = 2.0) -> None:
        self.t += seconds
        self.busy += seconds * (others + mine)
        self.own += seconds * mine

    def read(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own)


def test_governor_follows_the_load_and_waits_its_interval(monkeypatch):
    clock, calls = FakeClock(), []
    monkeypatch.setattr("draftsmith.models.threads.time.monotonic", lambda: clock.t)
    g = ThreadGovernor(2, interval_s=2.0, read=clock.read, set_threads=calls.append)
    assert g.active and g.threads == 2
    clock.advance(3, others=0.05)
    assert g.step() == 2 and calls == []  # alone: all threads
    clock.advance(1, others=1.8)
    assert g.step() == 2 and calls == []  # inside the interval: nothing measured yet
    clock.advance(1.5, others=1.8)
    assert g.step() == 1 and calls == [1]  # a busy neighbour: one thread
    clock.advance(2.5, others=0.5, mine=1.0)
    assert g.step() == 1  # inside the dead band
    clock.advance(2.5, others=0.0, mine=1.0)
    assert g.step() == 2 and calls == [1, 2]  # the neighbour is gone


def test_governor_is_inert_without_proc_or_with_one_thread():
    calls = []
    assert not ThreadGovernor(2, read=lambda: None, set_threads=calls.append).active
    g = ThreadGovernor(1, read=FakeClock().read, set_threads=calls.append)
    assert not g.active and g.step() == 1 and calls == []


def test_read_cpu_parses_proc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text("cpu  100 5 50 1000 7 3 2 11 0 0\ncpu0 1 2 3 4\n")
    # a command name with spaces and parentheses; utime 40, stime 10 are fields 14 and 15
    (tmp_path / "self" / "stat").write_text("42 (my (odd) name) R 1 2 3 4 5 6 7 8 9 10 40 10 0 0 20 0 3\n")
    s = read_cpu(tmp_path)
    hz = __import__("os").sysconf("SC_CLK_TCK")
    assert s is not None and s.busy == pytest.approx((100 + 5 + 50 + 3 + 2 + 11) / hz) and s.own == pytest.approx(50 / hz)
    assert read_cpu(tmp_path / "missing") is None


def test_who_adapts(tiny_model_dir):
    tiny = tiny_model_dir("llama", seed=0)
    assert LLM(str(tiny), max_len=64).engine.governor is not None  # threads not given: adapt
    one = LLM(str(tiny), max_len=64, threads=1)
    assert one.engine.governor is None  # threads given: exactly that
    assert build_engine(one.target, max_len=64).governor is None  # benchmarks, eval: fixed


@pytest.mark.parametrize("job, runner", [("regen", "draftsmith.data.regen.run_regen"),
                                         ("cache", "draftsmith.data.cache.run_cache")])
def test_cli_threads_flag_pins_the_threads(monkeypatch, job, runner):
    from draftsmith.cli import build_parser

    seen = []

    def stop(cfg):
        seen.append(cfg)
        raise SystemExit

    monkeypatch.setattr(runner, stop)
    for flags, adaptive in (([], True), (["--threads", "2"], False)):
        args = build_parser().parse_args([job, "--out", "x", *flags])
        with pytest.raises(SystemExit):
            args.func(args)
        assert seen[-1].adaptive_threads is adaptive

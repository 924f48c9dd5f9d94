"""House 57: the "one concept in one place" cleanups left from review 56, a group of tests each."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith.data.features import parse_layer_ids, spelled_layer_ids
from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_flags

ROOT = Path(__file__).resolve().parents[2]

# /proc/cpuinfo as three machines print it (cut to what matters: two processors, the other lines kept)
XEON_SPR = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx f16c fma avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile avx512_fp16 amx_fp16
vmx flags\t: vnmi preemption_timer ept
bugs\t\t: spectre_v1 spectre_v2

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx f16c fma avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile avx512_fp16 amx_fp16
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu vme sse sse2 avx f16c fma avx2 bmi2
bugs\t\t: sysret_ss_attrs
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve svebf16 i8mm bf16
CPU implementer\t: 0x41
CPU architecture: 8

processor\t: 1
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve svebf16 i8mm bf16
"""
GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize("text,has,lacks", [
    (XEON_SPR, {"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "fma"}, {"vnmi", "spectre_v1", "Intel(R)"}),
    (ZEN3, {"avx2", "fma", "f16c"}, {"avx512f", "sysret_ss_attrs"}),
    (GRAVITON3, {"asimd", "asimdhp", "bf16", "sve"}, {"0x41", "2100.00"}),
    (GRAVITON2, {"asimd", "asimdhp"}, {"bf16"}),
])
def test_one_cpu_flag_reader_reads_the_x86_flags_and_the_arm_features_line(tmp_path, text, has, lacks):
    """models/target read every word of /proc/cpuinfo, kernels/build only the x86 "flags" line
    (nothing on Arm); kernels/build.cpu_flags is now the one reader, of either line."""
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    flags = cpu_flags(f)
    assert has <= flags and not (lacks & flags), sorted(flags)
    assert cpu_flags(tmp_path / "missing") == frozenset()
    f.write_text("processor\t: 0\nmodel name\t: a CPU that lists no flags\n")
    assert cpu_flags(f) == frozenset()


@pytest.mark.parametrize("text,bf16,fp16", [(XEON_SPR, True, True), (ZEN3, False, False),
                                            (GRAVITON3, True, True), (GRAVITON2, False, True)])
def test_bf16_and_fp16_hardware_checks_answer_as_the_whole_text_reader_did(tmp_path, monkeypatch, text, bf16, fp16):
    from draftsmith.models import target

    f = tmp_path / "cpuinfo"
    f.write_text(text)
    monkeypatch.setattr(target, "cpu_flags", lambda: cpu_flags(f))
    words = set(text.split())  # what models/target read before
    assert target.cpu_has_fast_bf16() is bf16 is bool(words & {"avx512_bf16", "amx_bf16", "bf16"})
    assert target.cpu_has_fast_fp16() is fp16 is bool(words & {"avx512_fp16", "amx_fp16", "asimdhp"})


def test_one_layer_id_parser_for_cache_and_regen():
    """regen's --feature-layers check parsed ids itself beside features.parse_layer_ids; both now
    read them with spelled_layer_ids, naming their own flag and the bad value."""
    from draftsmith.data.regen_config import RegenConfig

    for spec in (None, "", " ", "default", " default "):
        assert spelled_layer_ids(spec) is None
        RegenConfig(feature_layers=spec)
    assert spelled_layer_ids(" 27, 1,") == [27, 1] and spelled_layer_ids((3, 1)) == [3, 1]
    RegenConfig(feature_layers="1,14,27")
    RegenConfig(feature_layers="0,99")  # the depth is the target's: checked once it loads
    for spec in ("abc", ",", "1,x", "1.5"):
        says = (f"--feature-layers expects comma-separated 0-based layer ids, e.g. 1,14,27 (or default), "
                f"got {spec!r}")
        with pytest.raises(DraftsmithError) as e:
            RegenConfig(feature_layers=spec)
        assert str(e.value) == says
        with pytest.raises(DraftsmithError) as e:
            parse_layer_ids(spec, 30)
        assert str(e.value) == says.replace("--feature-layers", "--layers")
    assert parse_layer_ids("default", 30) == (1, 14, 27) and parse_layer_ids("27, 1", 30) == (1, 27)
    with pytest.raises(DraftsmithError, match="no feature layers given"):
        parse_layer_ids([], 30)
    with pytest.raises(DraftsmithError, match=r"layer ids \[30\] are out of range"):
        parse_layer_ids("1,30", 30)
    with pytest.raises(DraftsmithError, match="layer ids repeat"):
        parse_layer_ids("1,1", 30)


# ---- the cache's manifest, read once on --resume ----


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3", seed=5)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _records(tiny: Path, n: int) -> list[dict]:
    from draftsmith.models.loading import weights_fingerprint

    g = torch.Generator().manual_seed(57)
    recs = []
    for i in range(n):
        ids = torch.randint(0, 256, (12 + i,), generator=g).tolist()
        recs.append({"id": f"r{i}", "source": "test", "split": "train", "input_ids": ids,
                     "loss_mask": [0] * 6 + [1] * (len(ids) - 6),
                     "target": {"id": str(tiny), "weights_hash": weights_fingerprint(tiny)}, "format_version": 1})
    return recs


def _write(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_cache_resume_reads_the_manifest_once(tiny, tmp_path, monkeypatch, one_thread):
    """`cache --resume` read the manifest for the saved --allow-target-mismatch, then again to
    resume it: now once, passed along; the saved option is still kept."""
    from draftsmith.data import cache
    from draftsmith.data.cache import MANIFEST, CacheConfig, run_cache

    recs = _records(tiny, 4)
    recs[1]["target"] = {"id": "other", "weights_hash": "0" * 16}
    data = _write(tmp_path / "d.jsonl", recs[:2])
    out = tmp_path / "c"
    cfg = dict(target=str(tiny), data=data, out=out, dtype="fp32", layers="1")
    assert run_cache(CacheConfig(**cfg, allow_target_mismatch=True))["num_samples"] == 2
    reads = []
    real = cache.read_manifest
    monkeypatch.setattr(cache, "read_manifest", lambda p: reads.append(p) or real(p))
    _write(data, recs)
    assert run_cache(CacheConfig(**cfg, resume=True))["num_samples"] == 4
    assert reads == [out]
    assert json.loads((out / MANIFEST).read_text())["options"]["allow_target_mismatch"] is True


def test_cache_resume_of_a_damaged_manifest_still_says_so_after_the_data_check(tiny, tmp_path, one_thread):
    from draftsmith.data.cache import MANIFEST, CacheConfig, run_cache

    data = _write(tmp_path / "d.jsonl", _records(tiny, 2))
    out = tmp_path / "c"
    run_cache(CacheConfig(target=str(tiny), data=data, out=out, layers="1"))
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(DraftsmithError, match="does not exist"):  # the data first, as before
        run_cache(CacheConfig(target=str(tiny), data=tmp_path / "typo.jsonl", out=out, layers="1", resume=True))
    with pytest.raises(DraftsmithError, match="the cache is damaged, rebuild it"):
        run_cache(CacheConfig(target=str(tiny), data=data, out=out, layers="1", resume=True))
    assert (out / MANIFEST).read_text() == "{not json"


# ---- benchmarks: a bench stage killed before its report goes on with --resume ----


def test_a_bench_stage_killed_before_its_report_is_continued_with_resume(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench_drafters = importlib.import_module("bench_drafters")

    out = tmp_path / "bench-humaneval"
    assert bench_drafters.bench_out(out) == ["--out", str(out)]  # not run yet
    out.mkdir()
    assert bench_drafters.bench_out(out) == ["--out", str(out)]  # nothing of a bench in it
    (out / "setup.json").write_text("{}")  # killed in its first tier
    assert bench_drafters.bench_out(out) == ["--out", str(out), "--resume"]
    (out / "results.jsonl").write_text("")  # killed after a tier
    assert bench_drafters.bench_out(out) == ["--out", str(out), "--resume"]
    (out / "setup.json").unlink()  # results without their setup: not resumed (bench refuses the directory)
    assert bench_drafters.bench_out(out) == ["--out", str(out)]
    assert bench_drafters.eval_out(out) == ["--out", str(out), "--overwrite"]  # eval stages: as before


def test_bench_drafters_kinds_subset_report_and_resume_guard(tmp_path, monkeypatch):
    """--kinds dflash,dspark: the report names the two it ran (title, ordering against DFlash only,
    table columns), and a work directory refuses to resume with other kinds (its stage markers hold
    those drafters only)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench_drafters = importlib.import_module("bench_drafters")
    sections = importlib.import_module("sections")

    r = json.loads((ROOT / "benchmarks" / "results" / "bench_drafters-long.json").read_text())
    r["setup"]["kinds"] = ["dflash", "dspark"]
    r["setup"]["overrides"].pop("eagle3")
    r["train"].pop("eagle3")
    for e in r["eval"].values():
        e["drafters"].pop("eagle3")
    for c in r["curve"].values():
        c.pop("eagle3")
    written: list[str] = []
    monkeypatch.setattr(sections, "write_section", lambda begin, end, text: written.append(text))
    bench_drafters.write_markdown(r, "sub")
    text = written[0]
    assert text.startswith("## Drafters at equal long budgets: DFlash vs DSpark, 30 CPU minutes each")
    assert " --kinds dflash,dspark " in text and "for all two" in text and "the two at once" in text
    assert "EAGLE" not in text
    assert "Ordering at T=0: DSpark τ 1.50 vs DFlash 1.42 (+6%); paper: +16–18% over DFlash." in text
    assert "| CPU minutes | DFlash | DSpark |" in text

    w = tmp_path / "work"
    w.mkdir()
    bench_drafters.check_kinds(w, ("dflash", "dspark"))
    bench_drafters.check_kinds(w, ("dflash", "dspark"))  # the same kinds resume
    with pytest.raises(SystemExit, match="holds a comparison of dflash,dspark; resume it with --kinds dflash,dspark"):
        bench_drafters.check_kinds(w, bench_drafters.KINDS)
    old = tmp_path / "old"  # a work dir from before kinds.json: the kinds it has runs of
    for k in bench_drafters.KINDS:
        (old / k).mkdir(parents=True)
    (old / ".train.done").touch()
    with pytest.raises(SystemExit, match="eagle3,dflash,dspark"):
        bench_drafters.check_kinds(old, ("dflash", "dspark"))
    bench_drafters.check_kinds(old, bench_drafters.KINDS)
    cut = tmp_path / "cut"  # killed in its first training run (one after the other): the rest may follow
    (cut / "eagle3").mkdir(parents=True)
    bench_drafters.check_kinds(cut, bench_drafters.KINDS)
    two = tmp_path / "two"  # killed while training --kinds dflash,dspark at once: not all three
    for k in ("dflash", "dspark"):
        (two / k).mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds a comparison of dflash,dspark"):
        bench_drafters.check_kinds(two, bench_drafters.KINDS)
    bench_drafters.check_kinds(two, ("dflash", "dspark"))


def test_bench_training_stage_times_each_process_from_its_launch_to_its_end(tmp_path, monkeypatch):
    """Training processes launched together are reaped in the order they end: each one's row has
    its own wall seconds (the one waited for second read 0.0 when it had ended first), a done marker
    for each that succeeded, and a failed one is reported once all have ended, its row kept."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench_drafters = importlib.import_module("bench_drafters")

    def child(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    t0 = time.perf_counter()
    procs = {"long": child("import time; time.sleep(2.5)"), "short": child("pass"), "bad": child("raise SystemExit(3)")}
    with pytest.raises(SystemExit, match=r"training failed: bad \(see .*train-bad.log\)"):
        bench_drafters.wait_measured(procs, tmp_path, t0)
    row = {n: json.loads((tmp_path / f"train-{n}.cpu.jsonl").read_text()) for n in procs}
    assert row["short"]["rc"] == 0 and row["long"]["rc"] == 0 and row["bad"]["rc"] == 3
    assert row["long"]["wall_s"] >= 2.5
    assert row["long"]["wall_s"] - row["short"]["wall_s"] >= 1.5  # the short one's own time, not the long one's
    assert (tmp_path / ".train-long.done").exists() and (tmp_path / ".train-short.done").exists()
    assert not (tmp_path / ".train-bad.done").exists()


def test_probe_knobs_names_the_trainers_stats_file_and_redoes_an_eval_of_other_variants(tmp_path, monkeypatch):
    """probe_knobs keeps torch out of its parent process, so it spells the trainer's statistics file
    itself: the two names must agree (--stats-from copies it where the trainer looks). Its eval
    stage is reused only for the same variants in the same order."""
    from draftsmith.train.trainer import STATS_FILE

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    probe_knobs = importlib.import_module("probe_knobs")
    assert probe_knobs.STATS_FILE == STATS_FILE
    assert probe_knobs.evaluated(tmp_path) is None
    (tmp_path / "report.json").write_text(json.dumps({"drafters": [{"label": "dspark:base"},
                                                                   {"label": "dspark:anchors64"}]}))
    assert probe_knobs.evaluated(tmp_path) == ["base", "anchors64"]
    assert set(probe_knobs.VARIANTS) >= {"base", "anchors64"} and probe_knobs.VARIANTS["base"][1] == []
    rounds = tmp_path / "rounds.jsonl"  # prompt a (two turns): 3 rounds committing 6 tokens; b: 1 round, 4
    rounds.write_text("".join(json.dumps({"request": q, "committed": c}) + "\n"
                              for q, c in (("a#0", 1), ("a#1", 2), ("b#0", 4), ("a#1", 3))))
    base = probe_knobs.per_request(rounds)
    assert base == {"a": (6, 3), "b": (4, 1)}
    assert probe_knobs.ratio_ci(base, base) == (1.0, 1.0, 1.0)
    assert probe_knobs.ratio_ci(base, {k: (2 * c, n) for k, (c, n) in base.items()}) == pytest.approx((2.0, 2.0, 2.0))
    ratio, lo, hi = probe_knobs.ratio_ci(base, {"a": (6, 3), "b": (8, 1)})  # only b's tau doubles
    assert ratio == pytest.approx((14 / 4) / (10 / 4)) and lo < ratio <= hi and lo >= 1.0

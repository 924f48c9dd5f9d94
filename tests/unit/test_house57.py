"""House 57: the "one concept in one place" cleanups left from review 56, a group of tests each."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data.features import parse_layer_ids, spelled_layer_ids
from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_flags

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

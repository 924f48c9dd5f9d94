"""drafters/precision.py: the dtype a model drafter computes in (`--drafter-dtype`)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.drafters.precision import drafter_dtype


@pytest.mark.parametrize("target_dtype, device, pays, want", [
    (torch.float32, "cpu", True, torch.bfloat16),  # AVX-512 / AMX kernels: half the bytes a round
    (torch.float32, "cpu", False, torch.float32),  # AVX2 or no kernels: the target's
    (torch.bfloat16, "cpu", True, torch.bfloat16),  # a bf16 target: its dtype
    (torch.float16, "cpu", True, torch.float16),
    (torch.float32, "cuda", True, torch.float32),  # on CUDA: the target's
    (torch.bfloat16, "cuda:0", False, torch.bfloat16),
])
def test_auto_follows_the_target_except_a_float32_target_on_a_fast_bf16_cpu(target_dtype, device, pays, want):
    assert drafter_dtype("auto", target_dtype, device, bf16_pays=pays) == want
    assert drafter_dtype(None, target_dtype, device, bf16_pays=pays) == want


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_taken_as_given(name):
    for device, pays in (("cpu", True), ("cpu", False), ("cuda", False)):
        assert drafter_dtype(name, torch.float32, device, bf16_pays=pays) == getattr(torch, name)
        assert drafter_dtype(getattr(torch, name), torch.bfloat16, device, bf16_pays=pays) == getattr(torch, name)


@pytest.mark.parametrize("bad", ["fp32", "int8", "", torch.int8])
def test_an_unknown_dtype_says_which_are_known(bad):
    with pytest.raises(DraftsmithError, match="auto, float32, bfloat16, float16"):
        drafter_dtype(bad, torch.float32, "cpu", bf16_pays=True)


def test_the_cli_refuses_an_unknown_drafter_dtype(capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--drafter", "ngram", "--drafter-dtype", "fp8", "--prompt", "hi"])
    assert e.value.code == 2
    assert "--drafter-dtype" in capsys.readouterr().err


def test_auto_keeps_the_target_dtype_for_a_kind_that_does_not_declare_auto_dtype():
    """A kind of someone else's may feed the target's float32 features straight into its own
    linears: "auto" runs it in the target's dtype unless the kind says it casts them."""
    from types import SimpleNamespace

    from draftsmith.drafters import registry

    target = SimpleNamespace(model=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")))
    plain_kind = registry.DrafterKind("mine", "mine:CKPT", "a kind of someone else's", lambda *a: None)
    assert not plain_kind.auto_dtype
    assert registry.resolve_dtype("auto", target, plain_kind) == torch.float32
    assert registry.resolve_dtype("bfloat16", target, plain_kind) == torch.bfloat16  # asked for: given
    for name in ("dspark", "dflash", "eagle3", "draft-model"):
        kind = registry.get(name)
        assert kind.auto_dtype
        assert registry.resolve_dtype("auto", target, kind) == drafter_dtype("auto", torch.float32, "cpu")


def test_every_avx512_build_counts_as_fast_bf16_and_avx2_does_not(monkeypatch):
    from draftsmith.drafters import precision
    from draftsmith.kernels import build

    for isa, want in (("avx512", True), ("avx512-bf16", True), ("avx512-bf16+amx", True), ("avx2", False)):
        monkeypatch.setattr(build, "cpu_kernels", lambda isa=isa: build.KernelStatus(True, True, "test", isa))
        assert precision.bf16_pays_on_cpu() is want, isa
    monkeypatch.setattr(build, "cpu_kernels", lambda: build.KernelStatus(False, False, "no compiler"))
    assert precision.bf16_pays_on_cpu() is False

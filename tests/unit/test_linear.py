"""Inference linears (models/linear.py), thread settings (models/threads.py) and the decoder's
backends against each other."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_flags, cpu_kernels
from draftsmith.models.linear import FastLinear, choose_backend
from draftsmith.models.loading import load_decoder
from draftsmith.models.threads import configure_threads, physical_cores

CPU_BACKENDS = (["torch", "mkl"] + (["onednn"] if torch.backends.mkldnn.is_available() else [])
                + (["kernels"] if cpu_kernels().ok else []))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_equals_f_linear(backend, dtype, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    lin = FastLinear.build(w, b, backend)
    assert lin.out_features == 96
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(0, 40), (1, 40), (3, 40), (2, 5, 40), (70, 40)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        y = lin(x)
        assert y.shape == ref.shape and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol * 10, rtol=tol)
    # a non-contiguous input (a transposed view) gives the same result
    xt = torch.randn(40, 4, generator=g).to(dtype).t()
    torch.testing.assert_close(lin(xt).float(), lin(xt.contiguous()).float())


def test_choose_backend():
    expected = "kernels" if cpu_kernels().ok else "onednn" if torch.backends.mkldnn.is_available() else "torch"
    assert choose_backend("auto", "cpu") == expected
    assert choose_backend("auto", "meta") == "torch"
    assert choose_backend("torch", "cpu") == "torch"
    with pytest.raises(DraftsmithError, match="unknown linear backend"):
        choose_backend("fastest", "cpu")
    with pytest.raises(DraftsmithError, match="CPU only"):
        choose_backend("onednn", "meta")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decoder_backends_agree_and_keep_parameters(tiny_model_dir, backend):
    """Every backend runs the same decoder: logits within float32 summation noise of F.linear's,
    and the checkpoint parameters still read back unchanged (state_dict, shared lm_head)."""
    path = tiny_model_dir("qwen2", seed=3)  # q/k/v bias: the fused bias path
    ref, dec = load_decoder(path, linear_backend="torch"), load_decoder(path, linear_backend=backend)
    assert dec.linear_backend == backend
    for k, v in ref.state_dict().items():
        assert torch.equal(dec.state_dict()[k], v), k
    ids = torch.randint(0, dec.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    a = ref(ids, ref.new_cache(2, 16)).logits
    b = dec(ids, dec.new_cache(2, 16)).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # a wrong weight layout (the transposed fused matrix) would not survive this comparison
    assert float((a - ref(ids.flip(1), ref.new_cache(2, 16)).logits).abs().max()) > 1e-2


def test_threads():
    before = torch.get_num_threads()
    try:
        assert physical_cores() >= 1
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
        assert configure_threads(None) == 1  # None keeps an explicit setting
        for bad in (0, -2, 1.5, True):
            with pytest.raises(DraftsmithError, match="positive integer"):
                configure_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_packed_linears_infer_like_f_linear_and_still_train():
    """pack_linears_for_inference_: same outputs without gradients, the usual autograd path with
    them, new weights picked up after an optimizer step, deep copies independent, state_dict
    unchanged."""
    import copy

    from draftsmith.models.linear import pack_linears_for_inference_

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8, bias=False))
    ref = copy.deepcopy(net)
    keys = set(net.state_dict())
    pack_linears_for_inference_(net)
    assert set(net.state_dict()) == keys
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)
    if torch.backends.mkldnn.is_available():  # the packed path really ran
        assert net[0].inference_pack._fast.backend == ("kernels" if cpu_kernels().ok else "onednn")
    for m in (net, ref):  # one identical SGD step on both
        loss = m(x).square().sum()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    torch.testing.assert_close(net[0].weight, ref[0].weight)
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)  # re-packed after the step
        twin = copy.deepcopy(net)
        twin[2].weight.zero_()
        assert float(twin(x).abs().max()) == 0.0
        torch.testing.assert_close(net(x), ref(x), atol=1e-5, rtol=1e-5)  # the original is untouched


def test_cpu_kernels_build_where_the_cpu_can_run_them():
    """On an x86-64 CPU with AVX-512, or AVX2 + FMA, and a C++ compiler the kernels must build and
    load: a broken build would otherwise fall back to oneDNN silently and only the speed would tell."""
    import platform
    import shutil

    status = cpu_kernels()
    flags = cpu_flags()
    can = (platform.machine() == "x86_64" and ("avx512f" in flags or {"avx2", "fma"} <= flags)
           and bool(shutil.which("c++") or shutil.which("g++")))
    assert status.ok == can, status.reason
    if not can:
        pytest.skip(f"no CPU kernels here: {status.reason}")
    if "avx512f" in flags:
        isa = "avx512-bf16" if "avx512_bf16" in flags else "avx512"
        # "+amx": bfloat16 linears on the tile unit (CPU flags and the OS's grant of the tile state)
        assert status.isa in (isa, isa + "+amx") and ("+amx" not in status.isa or "amx_bf16" in flags)
        assert status.bf16  # without AVX512-BF16 the bfloat16 weights are widened to float32 in registers
    else:  # AVX2: bfloat16 weights widened to float32 in registers
        assert (status.isa, status.bf16) == ("avx2", True)


def test_kernel_build_tunes_its_prefetches_by_cpu_family(tmp_path):
    """Zen 4 builds (AMD family 25 with AVX-512) get DS_PREFETCH_L2 (linears of 4+ rows prefetch into
    L2), other CPUs none; the define is part of the build key, so a home shared by both kinds of CPU
    keeps two builds."""
    from draftsmith.kernels import build

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                    "flags\t\t: fpu avx2 fma avx512f\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert build.cpu_family(info) == ("AuthenticAMD", 25)
    assert build.cpu_family(tmp_path / "missing") == ("", None)
    info.write_text("flags\t\t: fpu avx2 fma\n")  # no vendor or family line (an Arm kernel's layout)
    assert build.cpu_family(info) == ("", None)
    avx512, avx2 = frozenset({"avx2", "fma", "avx512f"}), frozenset({"avx2", "fma"})
    assert build.tuning_defines("AuthenticAMD", 25, avx512) == ["-DDS_PREFETCH_L2"]
    for other in (("AuthenticAMD", 25, avx2), ("AuthenticAMD", 26, avx512), ("AuthenticAMD", 23, avx2),
                  ("GenuineIntel", 6, avx512), ("", None, frozenset())):
        assert build.tuning_defines(*other) == [], other
    pytest.importorskip("setuptools")  # torch.utils.cpp_extension's import, in _command
    zen4 = build._command("c++", tmp_path / "a.so", family=("AuthenticAMD", 25), flags=avx512)
    zen3 = build._command("c++", tmp_path / "a.so", family=("AuthenticAMD", 25), flags=avx2)
    assert "-DDS_PREFETCH_L2" in zen4 and "-DDS_PREFETCH_L2" not in zen3
    assert build._key("c++", zen4, avx512) != build._key("c++", zen3, avx512)


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 7), (33, 65), (100, 576), (64, 3)])
def test_kernels_kernel_shapes_bias_and_batch_invariance(dtype, n, k):
    """Odd shapes (a partial 32-column block, an odd K in bfloat16), bias, 0..19 rows (every
    row-tile size), and the property the kernel is built for: a row's output is bit-identical
    whatever the number of rows computed with it, so verifying K drafts gives exactly the
    logits decoding them one by one would."""
    if dtype == torch.bfloat16 and not cpu_kernels().bf16:
        pytest.skip("no bfloat16 kernel in this build")
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        lin = FastLinear.build(w, bias, "kernels")
        assert lin.backend == "kernels"
        x = torch.randn(19, k, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        full = lin(x)
        assert full.shape == (19, n) and full.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(full.float(), ref, atol=tol * 10, rtol=tol)
        for m in range(0, 19):
            assert torch.equal(lin(x[: m + 1]), full[: m + 1]), m
            assert torch.equal(lin(x[m : m + 1]), full[m : m + 1]), m
        assert lin(x[:0]).shape == (0, n)


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_weights_of_2mb_and_more_pack_into_their_own_mapping_and_free_it(dtype):
    """A packed weight of >= 2 MB lives in its own huge-page-advised mapping (kernels/gemv.cpp
    packed_zeros): the same outputs (a partial block, an odd K in bfloat16) and batch invariance as
    the smaller ones above, and its memory is returned when the weight is dropped."""
    if dtype == torch.bfloat16 and not cpu_kernels().bf16:
        pytest.skip("no bfloat16 kernel in this build")
    g = torch.Generator().manual_seed(7)
    n, k = (1000, 601) if dtype == torch.float32 else (2000, 601)  # packed: 2.4 MB either way
    w = torch.randn(n, k, generator=g).to(dtype)
    lin = FastLinear.build(w, None, "kernels")
    assert lin.backend == "kernels"
    if sys.platform.startswith("linux"):  # the path taken: its own mapping, starting on a 2 MB boundary
        assert lin.weight.data_ptr() % (2 << 20) == 0
    x = torch.randn(9, k, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    full = lin(x)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), atol=tol * 10, rtol=tol)
    for m in range(9):
        assert torch.equal(lin(x[m : m + 1]), full[m : m + 1]), m
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return
    rss = lambda: int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # noqa: E731
    big = torch.randn(4096, 1024).to(dtype)  # packed: 16 MB (float32) / 8 MB (bfloat16)
    before = rss()
    for _ in range(40):  # 320-640 MB if the mappings leaked
        packed = FastLinear.build(big, None, "kernels")
        del packed
    assert rss() - before < 100 * 2**20


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
def test_kernels_float16_falls_back_per_linear_and_wrong_width_is_an_error():
    w = torch.randn(40, 24).half()
    assert FastLinear.build(w, None, "kernels").backend == "torch"
    lin = FastLinear.build(torch.randn(40, 24), None, "kernels")
    with pytest.raises(RuntimeError, match="features"):
        lin(torch.randn(2, 23))


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_the_composite(dtype):
    """The decode-step RMSNorm (kernels/gemv.cpp) against the decoder's torch composite: float32
    to a few ulps, bfloat16 to one bf16 ulp on the rare element where the float32 sums round
    differently; shapes [B, S, H] with H not a multiple of 16, outlier features like SmolLM2's."""
    from draftsmith.models.decoder import rms_norm, rms_norm_kernel

    g = torch.Generator().manual_seed(5)
    for shape in [(1, 1, 576), (3, 8, 576), (2, 1, 37), (0, 1, 64)]:
        x = torch.randn(*shape, generator=g)
        if x.numel():
            x[..., 3] *= 2e4
        x, w = x.to(dtype), (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
        ref, got = rms_norm(x, w, 1e-5), rms_norm_kernel(x, w, 1e-5)
        assert got.shape == ref.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=4e-7, atol=1e-7)
        else:
            close = (got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7
            assert bool(close.all()) and float((got != ref).float().mean() if x.numel() else 0) < 0.01


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_argmax_kernel_matches_logsumexp_and_argmax(dtype):
    """torch.ops.draftsmith.lse_argmax (the training statistics of drafters/block.py): the
    log-sum-exp of x + add against torch's (float32 sums: to a few ulps) and exactly torch's argmax
    of x, ties to the first index; widths off the vector size; a row where no column counts gives
    -inf; a mask of the wrong size is refused."""
    g = torch.Generator().manual_seed(9)
    for V in (49152, 1000, 37, 1):
        x = (torch.randn(5, V, generator=g) * 6).to(dtype)
        add = torch.zeros(V)
        add[torch.randperm(V, generator=g)[: V // 3]] = -torch.inf
        x[2, V // 2] = x[2].max() + 1  # a tie at the maximum: the first index wins
        x[2, V - 1] = x[2, V // 2]
        lse, top = torch.ops.draftsmith.lse_argmax(x, add)
        torch.testing.assert_close(lse, torch.logsumexp(x.float() + add, -1), rtol=1e-6, atol=1e-5)
        assert torch.equal(top, x.float().argmax(-1))
    lse, top = torch.ops.draftsmith.lse_argmax(torch.randn(2, 20, generator=g).to(dtype), torch.full((20,), -torch.inf))
    assert bool(torch.isinf(lse).all()) and bool((lse < 0).all())
    with pytest.raises(RuntimeError, match="add must be float32"):
        torch.ops.draftsmith.lse_argmax(torch.zeros(2, 20, dtype=dtype), torch.zeros(19))


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_match_the_torch_ops_they_replace(dtype):
    """The fused small ops of a decoder layer (kernels/gemv.cpp) against the torch ops the
    decoder runs without them: RoPE (cos per step or per row, D with and without whole 16-lane
    halves) and the residual add + RMSNorm bit-identical; SwiGLU's silu(gate) * up to a few
    float32 ulps (its exp is our own), inf / -inf / huge gates as torch gives them; and each
    token's row the same whatever the rows computed with it."""
    from draftsmith.models.decoder import rms_norm_kernel, rope_composite, rope_kernel

    g = torch.Generator().manual_seed(11)
    ops = torch.ops.draftsmith
    for B, S, heads, D, n, per_row in [(1, 1, 15, 64, 12, False), (3, 5, 15, 64, 15, True), (2, 3, 4, 6, 3, False)]:
        x = torch.randn(B, S, heads, D, generator=g).to(dtype)
        cos, sin = (torch.randn(B if per_row else 1, S, 1, D, generator=g).to(dtype) for _ in range(2))
        got = rope_kernel(x, cos, sin, n)
        assert got.shape == (B, S, n, D) and torch.equal(got, rope_composite(x, cos, sin, n))
    with pytest.raises(RuntimeError, match="rope"):
        ops.rope(x, cos[:, :1], sin[:, :1], 1)  # cos for 1 position, x has 3

    gu = (torch.randn(3, 4, 2 * 1536 + 2 * 5, generator=g) * 4).to(dtype)  # I = 1541: a tail past 16 lanes
    gu[0, 0, :5] = torch.tensor([-100.0, 100.0, 0.0, float("inf"), -float("inf")]).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref, got = F.silu(gate) * up, ops.silu_mul(gu)
    assert got.shape == ref.shape and got.dtype == dtype
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref.isinf(), got.isinf())
    assert torch.equal(ref[ref.isinf()], got[got.isinf()])
    ok = ref.isfinite()
    if dtype == torch.float32:
        torch.testing.assert_close(got[ok], ref[ok], rtol=1e-6, atol=1e-30)
    else:  # one bf16 ulp where the float32 silu rounds the other way
        assert bool(((got[ok].float() - ref[ok].float()).abs() <= ref[ok].float().abs() * 2**-7).all())
    for m in range(1, 4):
        assert torch.equal(ops.silu_mul(gu[:, m - 1 : m]).nan_to_num(), got[:, m - 1 : m].nan_to_num())

    x, a = (torch.randn(2, 3, 576, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    s, h = ops.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(s, x + a) and torch.equal(h, rms_norm_kernel(x + a, w, 1e-5))
    with pytest.raises(RuntimeError, match="one shape"):
        ops.add_rms_norm(x, a[:, :1], w, 1e-5)


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # qwen3: q/k norms before RoPE
def test_prepared_decoder_uses_the_fused_ops_and_matches_the_unfused_path(tiny_model_dir, model_type):
    """With the "kernels" linears a float32 decoder runs RoPE, SwiGLU and add + norm as kernels;
    its logits equal the composite path's up to silu's few ulps (the reference: the same model
    with the fused ops switched off, `set_fused_ops_(False)`)."""
    from draftsmith.models.decoder import rms_norm_kernel, rope_composite, rope_kernel

    m = load_decoder(tiny_model_dir(model_type), linear_backend="kernels")
    layer = m.model.layers[0]
    assert layer.self_attn.rope_fn is rope_kernel and layer.add_norm_fn is not None
    assert layer.mlp.glu is torch.ops.draftsmith.silu_mul and layer.norm_fn is rms_norm_kernel
    ids = torch.randint(0, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    fused = m(ids, m.new_cache(2, 16)).logits
    m.set_fused_ops_(False)
    assert layer.self_attn.rope_fn is rope_composite and layer.add_norm_fn is None and layer.mlp.glu == layer.mlp._glu
    plain = m(ids, m.new_cache(2, 16)).logits
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_layer_as_one_kernel_call_gives_the_same_bits_as_op_by_op(tiny_model_dir, model_type, dtype, monkeypatch):
    """DecoderLayer.forward_step (kernels/gemv.cpp `layer`) against the op-by-op forward of the same
    prepared model: prefill from 0 (causal), a verify block after a cached prefix (mask), decode
    of two rows at one start, and rows 1-2 of a 3-row cache; logits, every layer's output and the
    KV cache bit-identical; Qwen3's q / k norms included (the kernel norm on both paths)."""
    if dtype == torch.bfloat16 and not cpu_kernels().bf16:
        pytest.skip("no bfloat16 kernel here")
    m = load_decoder(tiny_model_dir(model_type), dtype=dtype, linear_backend="kernels")
    assert all(layer.step_args is not None for layer in m.model.layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.config.vocab_size, (3, 12), generator=g)
    layers = tuple(range(m.config.num_layers))

    def run(one_call: bool):
        m.set_fused_ops_(True, one_call_layers=one_call)
        cache, outs = m.new_cache(3, 32), []
        steps = [(ids[:2, :6], None, 0), (ids[:2, 6:10], None, 6), (ids[:2, 10:11], None, 10),
                 (ids[1:3, :5], torch.tensor([1, 2]), 0)]
        for x, rows, start in steps:
            r = torch.arange(x.shape[0]) if rows is None else rows
            cache.lengths[r] = start
            o = m(x, cache, rows=rows, layer_ids=layers)
            outs += [o.logits, *o.hidden.values(), o.final_hidden]
            cache.lengths[r] = start + x.shape[1]
        return outs + cache.k + cache.v

    from draftsmith.models.decoder import DecoderLayer

    calls = []
    step = DecoderLayer.forward_step
    monkeypatch.setattr(DecoderLayer, "forward_step", lambda self, *a: calls.append(1) or step(self, *a))
    fused = run(True)
    assert len(calls) == 4 * m.config.num_layers  # every layer of every step took the one call
    plain = run(False)
    assert len(calls) == 4 * m.config.num_layers and len(fused) == len(plain)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    gemma = load_decoder(tiny_model_dir("gemma3_text"), linear_backend="kernels")  # sandwich norms, sliding
    assert all(layer.step_args is None for layer in gemma.model.layers)

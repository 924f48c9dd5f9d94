"""Inference linears (models/linear.py), thread settings (models/threads.py) and the decoder's
backends against each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.models.linear import FastLinear, choose_backend
from draftsmith.models.loading import load_decoder
from draftsmith.models.threads import configure_threads, physical_cores

CPU_BACKENDS = ["torch", "mkl"] + (["onednn"] if torch.backends.mkldnn.is_available() else [])


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
    assert choose_backend("auto", "cpu") == ("onednn" if torch.backends.mkldnn.is_available() else "torch")
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
    if torch.backends.mkldnn.is_available():
        assert net[0].inference_pack._fast.backend == "onednn"  # the packed path really ran
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

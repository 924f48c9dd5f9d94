"""The same code on CUDA in bf16 (marked `gpu`: skipped without CUDA; run by
benchmarks/device_check.sh on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.models.loading import load_decoder

pytestmark = pytest.mark.gpu
PROMPTS = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n", "abcabcabcabc", "z"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("qwen3", seed=0)


def test_cuda_logits_match_cpu_float32(tiny):
    cpu = load_decoder(tiny)
    gpu = load_decoder(tiny, device="cuda")
    assert gpu.linear_backend == "torch"
    ids = torch.randint(0, cpu.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    a = cpu(ids, cpu.new_cache(3, 16)).logits
    b = gpu(ids, gpu.new_cache(3, 16)).logits.cpu()
    torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model:SELF"])
def test_cuda_bf16_greedy_equals_plain(tiny, drafter):
    drafter = drafter.replace("SELF", str(tiny))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny), device="cuda", max_batch=4, max_len=128)
    assert plain.target.model.dtype == torch.bfloat16  # the CUDA default
    spec = LLM(str(tiny), policy="fixed", device="cuda", drafter=drafter, num_speculative_tokens=4, max_batch=4, max_len=128)
    ref = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == ref
    assert spec.last_stats.draft_accepted > 0

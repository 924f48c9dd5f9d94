"""Fixtures shared by every test tier.

- `default_target_dir` (session): the HF-format directory of the built-in default target
  (`smollm2-135m`). The first use on a machine converts the packaged GGUF (~30 s) into
  `$DRAFTSMITH_HOME` (default ~/.cache/draftsmith); later sessions reuse it.
- `tiny_model_dir` (session): a factory `tiny_model_dir(model_type="llama", **config)` that
  writes a tiny random HF checkpoint (config.json + model.safetensors + a byte-level
  tokenizer with a ChatML template) to a fresh temporary directory and returns its path.
  Every call writes a new directory, so a test may damage its copy freely.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub

# Defaults per family: hidden 64-128, 2-4 layers, GQA, vocab = 256 bytes + 3 specials + pad.
_TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "qwen2": dict(  # q/k/v carry a bias
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen3": dict(  # q/k RMSNorm; explicit head_dim != hidden / heads
        hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(  # Qwen3 attention + 4 experts, top-2 (renormalised); layer 1 dense
        hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False,
    ),
    "gemma3_text": dict(  # window 4 on layers 0, 1, 3; layer 2 global with a linearly scaled RoPE
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}},
        tie_word_embeddings=True,
    ),
}
TINY_VOCAB = 272
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokenizer():
    """Byte-level tokenizer, no merges: ids 0-255 are bytes, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = _CHATML
    return fast


def make_tiny_model(out: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `model_type` checkpoint to `out` and return `out`.

    Weights are drawn larger than HF's init (std 0.1, norms around 1, biases non-zero) so
    attention is far from uniform and parity tests can tell RoPE / norm / bias bugs apart.
    `overrides` go straight into the HF config (e.g. `rope_parameters={...}`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in _TINY_DEFAULTS:
        raise ValueError(f"no tiny defaults for {model_type!r}; known: {sorted(_TINY_DEFAULTS)}")
    tok = _tiny_tokenizer()
    kw: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=0.1,
    )
    kw.update(_TINY_DEFAULTS[model_type])
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny tensors: on a shared 2-core box extra intra-op threads only spin. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `tiny_model_dir("qwen3", seed=1, tie_word_embeddings=False) -> Path`."""

    def make(model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{model_type}"), model_type, seed, **overrides)

    return make


@pytest.fixture(scope="session")
def default_target_dir() -> Path:
    """HF-format directory of the default target; converts once per machine (~30 s)."""
    from draftsmith.models.registry import resolve_target

    _, path = resolve_target("smollm2-135m")
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA: skipped cleanly on a CPU-only machine (benchmarks/device_check.sh
    runs them where a GPU is lent)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs in benchmarks/device_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# CI guard: a run in which fewer tests passed than expected fails (a suite that only skips, or
# that silently lost a file, must not look green). .ci/run sets DRAFTSMITH_MIN_PASSED; it is
# taken out of the environment so that pytest runs started by tests (device_check.sh) don't
# inherit it.
_MIN_PASSED = int(os.environ.pop("DRAFTSMITH_MIN_PASSED", "0") or 0)
_PASSED = {"n": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _PASSED["n"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    want = _MIN_PASSED
    if want and exitstatus == 0 and _PASSED["n"] < want:
        print(f"\ndraftsmith: only {_PASSED['n']} tests passed; CI expects at least {want} "
              "(a test file was lost or everything skipped)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

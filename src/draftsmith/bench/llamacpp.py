"""llama.cpp as a peer (`--peers llamacpp`): the CPU engine a user would otherwise pick.

Two configurations of the concurrency-1 tier, through llama-cpp-python (an optional extra:
`pip install 'draftsmith[llamacpp]'`, built from source by pip):
    llamacpp:generate        plain decoding
    llamacpp:prompt-lookup   its prompt-lookup speculation (`LlamaPromptLookupDecoding`)
Same weights at the same precision as Draftsmith's engine: a built-in target's packaged GGUF
rewritten at the engine's dtype (models/gguf_precision.py), or `--peer-gguf FILE` for any
other target. Prompts go in as Draftsmith's token ids (the same chat template, no second
tokenizer); greedy at temperature 0, else sampled with the same temperature / top-p and seed;
llama.cpp's own repetition penalty and min-p are turned off. Every request starts from an
empty KV cache (no prefix reuse across requests, as in our engine). Timestamps are taken as
each token is yielded: exact for TTFT and gaps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from draftsmith.bench.loadgen import BenchRequest
from draftsmith.bench.metrics import RequestRecord, RunResult, sha_of_ids
from draftsmith.bench.peers import run_one_at_a_time
from draftsmith.errors import DraftsmithError

LLAMACPP_GENERATE = "llamacpp:generate"
LLAMACPP_LOOKUP = "llamacpp:prompt-lookup"
INSTALL_HINT = "pip install 'draftsmith[llamacpp]' (builds llama-cpp-python from source: needs cmake and a C++ compiler)"


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise DraftsmithError(f"--peers llamacpp needs llama-cpp-python; {INSTALL_HINT}") from None
    return llama_cpp


class LlamaCppPeer:
    """One llama.cpp configuration; `run` accepts only concurrency 1, closed loop (batch 1)."""

    kind = "peer"

    def __init__(self, label: str, llm, eos_ids: Sequence[int], info: dict, n_ctx: int, extra: int = 0) -> None:
        self.label, self.llm, self.eos_ids, self.info = label, llm, list(eos_ids), info
        self.n_ctx, self.extra = n_ctx, extra  # context, and tokens a round may look past the output (drafts)

    def one(self, req: BenchRequest, t0: float) -> RequestRecord:
        """One request on its own (times relative to t0): what run() does per request, and what a
        script interleaving configurations prompt by prompt calls (benchmarks/bench_foundation.py)."""
        p = req.params
        if len(req.token_ids) + p.max_tokens + self.extra > self.n_ctx:
            raise DraftsmithError(f"{self.label}: prompt {req.prompt_id} ({len(req.token_ids)} tokens) + max_tokens "
                                  f"{p.max_tokens} does not fit llama.cpp's context of {self.n_ctx}; lower "
                                  "--max-prompt-tokens")
        greedy = p.temperature <= 0
        if not greedy and p.seed is not None:
            self.llm.set_seed(int(p.seed))
        self.llm.reset()  # a full prefill per request, like the engine
        out: list[int] = []
        stamps: list[float] = []
        t_arr = time.perf_counter()
        gen = self.llm.generate(list(req.token_ids), top_k=1 if greedy else 0, top_p=1.0 if greedy else p.top_p,
                                min_p=0.0, temp=0.0 if greedy else p.temperature, repeat_penalty=1.0, reset=True)
        for tok in gen:
            stamps.append(time.perf_counter())
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= p.max_tokens:
                break
        gen.close()
        t_end = time.perf_counter()
        rec = RequestRecord(index=req.index, prompt_id=req.prompt_id, t_arrival=t_arr - t0, e2e=t_end - t_arr,
                            output_tokens=len(out), output_sha=sha_of_ids(out),
                            finish_reason="stop" if out and out[-1] in self.eos_ids else "length")
        rec.ttft = (stamps[0] - t_arr) if stamps else rec.e2e
        for a, b in zip(stamps, stamps[1:]):
            rec.deliveries.append([b - a, 1])
        return rec

    def run(self, requests: Sequence[BenchRequest], concurrency: int, offsets=None,
            on_done: Callable[[RequestRecord], None] = lambda r: None) -> RunResult:
        return run_one_at_a_time("llama.cpp", self.one, requests, concurrency, offsets, on_done)


def peer_gguf(target, gguf: str | None, home: Path) -> Path:
    """The GGUF llama.cpp runs: `gguf` when given, else the built-in target's GGUF at the
    engine's dtype (written once)."""
    from draftsmith.models.gguf_precision import precision_of, target_gguf
    from draftsmith.models.registry import BUILTIN_TARGETS

    if gguf:
        path = Path(gguf)
        if not path.is_file():
            raise DraftsmithError(f"--peer-gguf {gguf}: no such file")
        return path
    if target.target_id not in BUILTIN_TARGETS:
        raise DraftsmithError(f"--peers llamacpp: target {target.target_id!r} is not built in, so there is no GGUF "
                              "of it here; convert it with llama.cpp's convert_hf_to_gguf.py at the same precision "
                              "and pass --peer-gguf FILE")
    return target_gguf(target.target_id, precision_of(str(target.model.dtype).removeprefix("torch.")), home)


def build_llamacpp_peers(target, eos_ids: Sequence[int], lookup_tokens: int = 10, gguf: str | None = None,
                         threads: int | None = None, n_ctx: int = 4096) -> list[LlamaCppPeer]:
    """llama.cpp plain and prompt-lookup peers for a LoadedTarget on the CPU.

    The prompt-lookup one keeps logits for every position (llama-cpp-python verifies drafts
    from them; its score buffer is n_ctx x vocabulary floats, and it must be asked for with
    logits_all=True or a draft batch overflows it)."""
    from draftsmith.models.registry import draftsmith_home

    if target.model.device.type != "cpu":
        raise DraftsmithError("--peers llamacpp runs llama.cpp on the CPU; benchmark a CPU target (--device cpu)")
    llama_cpp = _import_llama_cpp()
    path = peer_gguf(target, gguf, draftsmith_home())
    import torch

    n_threads = threads or torch.get_num_threads()
    kw = dict(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    info = {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "gguf": str(path),
            "gguf_bytes": os.path.getsize(path), "threads": n_threads}
    try:
        plain = llama_cpp.Llama(**kw)
        lookup = llama_cpp.Llama(**kw, logits_all=True, draft_model=llama_cpp.llama_speculative.LlamaPromptLookupDecoding(
            num_pred_tokens=lookup_tokens))
    except Exception as e:  # noqa: BLE001 - llama-cpp-python raises ValueError / RuntimeError
        raise DraftsmithError(f"--peers llamacpp: llama.cpp cannot load {path}: {e}") from None
    return [LlamaCppPeer(LLAMACPP_GENERATE, plain, eos_ids, {**info, "draft": None}, n_ctx),
            LlamaCppPeer(LLAMACPP_LOOKUP, lookup, eos_ids, {**info, "draft": f"prompt lookup, {lookup_tokens} tokens"},
                         n_ctx, extra=lookup_tokens + 1)]

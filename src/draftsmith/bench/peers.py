"""Peers in the same run: what a user would otherwise pick, on the same target and prompts.

HF transformers at batch 1 (`--peers hf`), each a configuration of the concurrency-1 tier:
    hf:generate         plain `model.generate`
    hf:prompt-lookup    `generate(prompt_lookup_num_tokens=N)` (HF's n-gram speculation)
    hf:assistant        `generate(assistant_model=...)` when `--peer-assistant PATH` is given
The same weights (the target's HF directory), dtype and device as Draftsmith's engine; greedy
at temperature 0, else sampled with the same temperature / top-p and seed. End-to-end times
are exact (wall around `generate`); TTFT and inter-token gaps come from a streamer's
callbacks, which HF may deliver up to one step late.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from draftsmith.bench.loadgen import BenchRequest
from draftsmith.bench.metrics import RequestRecord, RunResult, sha_of_ids
from draftsmith.errors import DraftsmithError
from draftsmith.models.registry import resolve_target

HF_GENERATE = "hf:generate"
HF_LOOKUP = "hf:prompt-lookup"
HF_ASSISTANT = "hf:assistant"


class _Clock:
    """A transformers streamer that only timestamps: the first put() is the prompt."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.puts: list[tuple[float, int]] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def _load_hf(path, device: torch.device, dtype: torch.dtype):
    # Imported here: transformers' model classes take 0.44 s to import (measured) and only
    # `--peers hf` needs them.
    from transformers import AutoModelForCausalLM

    from draftsmith.progress import hf_bars_on_terminal_only

    with hf_bars_on_terminal_only():  # its "Loading weights" bar: not in log files
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


class HFPeer:
    """One HF configuration; `run` accepts only concurrency 1, closed loop (batch 1)."""

    kind = "peer"

    def __init__(self, label: str, model, gen_kwargs: dict, eos_ids: Sequence[int], pad_id: int | None,
                 info: dict) -> None:
        self.label = label
        self.model = model
        self.gen_kwargs = gen_kwargs
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else None)
        self.info = info

    def one(self, req: BenchRequest, t0: float) -> RequestRecord:
        """One request on its own (times relative to t0): what run() does per request, and what a
        script interleaving configurations prompt by prompt calls (benchmarks/bench_foundation.py)."""
        p = req.params
        device = self.model.device
        x = torch.tensor([list(req.token_ids)], device=device)
        kw = dict(self.gen_kwargs)
        if p.temperature > 0:
            kw.update(do_sample=True, temperature=p.temperature, top_p=p.top_p)
            if p.seed is not None:
                torch.manual_seed(p.seed)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        clock = _Clock()
        t_arr = time.perf_counter()
        with torch.inference_mode():
            y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=p.max_tokens,
                                    eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id,
                                    streamer=clock, **kw)
        t_end = time.perf_counter()
        out = y[0, x.shape[1]:].tolist()
        # drop anything after the first EOS (padding), keeping the EOS like the engine does
        for j, t in enumerate(out):
            if t in self.eos_ids:
                out = out[: j + 1]
                break
        rec = RequestRecord(index=req.index, prompt_id=req.prompt_id, t_arrival=t_arr - t0, e2e=t_end - t_arr,
                            output_tokens=len(out), output_sha=sha_of_ids(out),
                            finish_reason="stop" if out and out[-1] in self.eos_ids else "length")
        if clock.puts:
            rec.ttft = clock.puts[0][0] - t_arr
            prev = clock.puts[0][0]
            for t, n in clock.puts[1:]:
                rec.deliveries.append([t - prev, n])
                prev = t
        else:
            rec.ttft = rec.e2e
        return rec

    def run(self, requests: Sequence[BenchRequest], concurrency: int, offsets=None,
            on_done: Callable[[RequestRecord], None] = lambda r: None) -> RunResult:
        return run_one_at_a_time("HF", self.one, requests, concurrency, offsets, on_done)


def run_one_at_a_time(who: str, one: Callable[[BenchRequest, float], RequestRecord], requests: Sequence[BenchRequest],
                      concurrency: int, offsets, on_done: Callable[[RequestRecord], None]) -> RunResult:
    """A peer's tier: the requests one after another (batch 1, closed loop), `one(request, t0)`
    timing each; any other concurrency or an arrival schedule is refused."""
    if concurrency != 1 or offsets is not None:
        raise DraftsmithError(f"{who} peers run at batch 1 in a closed loop only")
    t0 = time.perf_counter()
    recs = []
    for req in requests:
        recs.append(one(req, t0))
        on_done(recs[-1])
    return RunResult(recs, wall_s=time.perf_counter() - t0)


def build_hf_peers(target, eos_ids: Sequence[int], lookup_tokens: int = 10,
                   assistant: str | None = None) -> list[HFPeer]:
    """HF transformers peers for a LoadedTarget (its HF directory, dtype and device)."""
    device, dtype = target.model.device, target.model.dtype
    try:
        model = _load_hf(target.path, device, dtype)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise DraftsmithError(f"--peers hf: transformers cannot load {target.path}: {e}") from None
    pad = getattr(target.tokenizer, "pad_token_id", None)
    base = {"transformers_class": type(model).__name__, "weights": str(target.path), "dtype": str(dtype),
            "device": str(device)}
    peers = [
        HFPeer(HF_GENERATE, model, {}, eos_ids, pad, {**base, "generate_kwargs": {}}),
        HFPeer(HF_LOOKUP, model, {"prompt_lookup_num_tokens": lookup_tokens}, eos_ids, pad,
               {**base, "generate_kwargs": {"prompt_lookup_num_tokens": lookup_tokens}}),
    ]
    if assistant:
        _, apath = resolve_target(assistant)
        try:
            amodel = _load_hf(apath, device, dtype)
        except Exception as e:  # noqa: BLE001
            raise DraftsmithError(f"--peer-assistant: transformers cannot load {apath}: {e}") from None
        peers.append(HFPeer(HF_ASSISTANT, model, {"assistant_model": amodel}, eos_ids, pad,
                            {**base, "generate_kwargs": {"assistant_model": str(apath)}}))
    return peers

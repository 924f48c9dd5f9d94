"""The in-process backend: the target loaded here once, each configuration (the no-drafter
baseline and every drafter) an Engine over it, peers (HF transformers, llama.cpp) beside them when asked for."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench.config import BASELINE, CONTROL, BenchConfig
from draftsmith.bench.loadgen import run_engine
from draftsmith.bench.machine import proc_bytes
from draftsmith.bench.metrics import RunResult
from draftsmith.bench.llamacpp import build_llamacpp_peers
from draftsmith.bench.peers import build_hf_peers
from draftsmith.bench.phases import Phase
from draftsmith.engine.builder import build_engine
from draftsmith.eval.runner import default_block_size, load_drafter
from draftsmith.models.prompts import encode_messages
from draftsmith.models.target import eos_token_ids, load_target
from draftsmith.policy.fixed import FixedK


class EngineRunner:
    """One in-process configuration: a drafter + policy on an Engine over the shared target."""

    def __init__(self, label: str, kind: str, engine, info: dict,
                 tokenize: Callable[[list[dict]], list[int]] | None = None) -> None:
        self.label, self.kind, self.engine, self.info, self.tokenize = label, kind, engine, info, tokenize

    def run(self, requests, concurrency, offsets, on_done) -> RunResult:
        return run_engine(self.engine, requests, concurrency, offsets, on_done, tokenize=self.tokenize)


class InProcessBackend:
    def __init__(self, cfg: BenchConfig, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)
        self.eos = eos_token_ids(self.target)
        self.model = self.target.model
        self.peers: list | None = None
        self.drafters: dict[str, dict] = {}
        for spec in cfg.drafters:  # resolve (and validate) every drafter before measuring anything
            loaded = load_drafter(spec, self.target, 1, 64, cfg.drafter_dtype)
            k = cfg.num_speculative_tokens or default_block_size(loaded, fallback=5)
            self.drafters[spec] = {
                "label": spec, "spec": spec, "kind": loaded.kind, "num_speculative_tokens": k, "policy": cfg.policy,
                "checkpoint": str(Path(loaded.checkpoint).resolve()) if loaded.checkpoint else None,
                "checkpoint_config": loaded.config or None,
                "calibration_temperatures": list(loaded.temperatures) if loaded.temperatures else None,
                "calibration_regime": loaded.sts.regime if loaded.sts else None,  # rows it applies to (None: all)
                "calibration_applied": loaded.applied_at(cfg.temperature) is not None,  # at this bench's temperature
                "dtype": loaded.dtype,
            }
            del loaded
        self.max_k = max([d["num_speculative_tokens"] for d in self.drafters.values()] + [0])
        self.context_len = ctx = self.model.config.max_position_embeddings
        self.max_prompt_tokens = cfg.max_prompt_tokens or max(1, ctx - cfg.max_tokens - self.max_k - 2)
        params = sum(p.numel() for p in self.model.parameters())
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.target_info = {
            "id": self.target.target_id, "path": str(self.target.path), "weights_hash": self.target.weights_hash,
            "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device),
            "parameters": params, "weights_bytes": self.weights_bytes, "max_position_embeddings": ctx,
            "eos_token_ids": list(self.eos), "model_type": self.model.config.model_type,
        }

    @property
    def weights_hash(self) -> str:
        return self.target.weights_hash

    def tokenize(self, messages: list[dict]) -> list[int]:
        return encode_messages(self.target.tokenizer, messages)

    def runners(self, phase: Phase, max_len: int) -> list:
        C = phase.concurrency
        out: list = []
        shared_cache = None
        for label in self.cfg.config_labels:
            if label in (BASELINE, CONTROL):  # the control: plain decoding again, an engine of its own
                engine = build_engine(self.target, "none", FixedK(0), 0, C, max_len, cache=shared_cache,
                                      enable_prefix_caching=self.cfg.enable_prefix_caching)
                kind = "baseline" if label == BASELINE else "control"
                info = _plain_info(label, "none")
            else:
                info = self.drafters[label]
                # Configurations never run at the same time and every run leaves all rows free,
                # so they share one target KV cache (rows are reset on admission; a run starts by
                # forgetting the prefixes an earlier run left: bench/loadgen.py).
                engine = build_engine(self.target, label, self.cfg.policy, info["num_speculative_tokens"], C, max_len,
                                      cache=shared_cache, drafter_dtype=self.cfg.drafter_dtype,
                                      enable_prefix_caching=self.cfg.enable_prefix_caching)
                kind = "drafter"
            shared_cache = engine.cache
            out.append(EngineRunner(label, kind, engine, info, self.tokenize))
        if phase.with_peers:
            if self.peers is None:
                self.peers = []
                if "hf" in self.cfg.peers:
                    self.peers += build_hf_peers(self.target, self.eos, self.cfg.peer_lookup_tokens,
                                                 self.cfg.peer_assistant)
                if "llamacpp" in self.cfg.peers:
                    # room for the longest admitted request
                    n_ctx = min(self.context_len,
                                self.max_prompt_tokens + self.cfg.max_tokens + self.cfg.peer_lookup_tokens + 1)
                    self.peers += build_llamacpp_peers(self.target, self.eos, self.cfg.peer_lookup_tokens,
                                                       self.cfg.peer_gguf, n_ctx=n_ctx)
            out.extend(self.peers)
        return out

    def memory(self, runner) -> dict:
        m: dict[str, Any] = {"rss_bytes": proc_bytes("VmRSS"), "process_peak_rss_bytes": proc_bytes("VmHWM"),
                             "peak_rss_scope": "process lifetime (VmHWM)"}
        engine = getattr(runner, "engine", None)
        bpt = (2 * self.model.config.num_layers * self.model.config.num_kv_heads * self.model.config.head_dim
               * self.model.dtype.itemsize)
        m["kv_bytes_per_token"] = bpt
        if engine is not None:
            m["kv_cache_bytes"] = getattr(engine.cache, "bytes", None)
            m["kv_cache_rows"] = getattr(engine.cache, "max_rows", None)
            m["kv_cache_max_len"] = getattr(engine.cache, "max_len", None)
        if self.model.device.type == "cuda":
            dev = self.model.device
            free, total = torch.cuda.mem_get_info(dev)
            cached_free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            m["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
            m["cuda_total_bytes"] = total
            m["kv_headroom_bytes"] = free + cached_free
            m["kv_headroom_source"] = "cuda free + allocator-cached"
        else:
            m["kv_headroom_bytes"] = proc_bytes("MemAvailable", "/proc/meminfo")
            m["kv_headroom_source"] = "host MemAvailable"
        if m.get("kv_headroom_bytes") is not None:
            m["kv_headroom_tokens"] = int(m["kv_headroom_bytes"] // bpt)
        return m

    def reset_peak(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.model.device)

    def release(self, runners: list) -> None:
        for r in runners:
            if hasattr(r, "engine"):
                r.engine = None
        runners.clear()
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def setup(self) -> dict:
        return {"mode": "in-process", "target": self.target_info, "drafters": [
            _plain_info(BASELINE, None), *self.drafters.values(),
            *([_plain_info(CONTROL, None)] if self.cfg.control else [])]}


def _plain_info(label: str, policy: str | None) -> dict:
    """The configuration entry of plain decoding: the baseline, or the A/A control."""
    return {"label": label, "spec": BASELINE, "kind": "none", "num_speculative_tokens": 0, "policy": policy,
            "checkpoint": None}

"""The Python front door: `LLM(target, drafter=...).generate(prompts, SamplingParams(...))`.

Mirrors vLLM's offline API: a list of prompts in, a list of `RequestOutput` out (text,
token ids, finish reason) plus the speculative stats Draftsmith is about.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from draftsmith.core.sampling import SamplingParams
from draftsmith.drafters.base import Drafter
from draftsmith.drafters.catalogue import build_drafter
from draftsmith.engine.engine import Engine, EngineConfig
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import LoadedTarget
from draftsmith.models.target import eos_token_ids, load_target
from draftsmith.models.threads import configure_threads
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.heuristic import HeuristicK


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


@dataclass
class GenerateStats:
    """Totals over one generate() call."""

    wall_time_s: float
    output_tokens: int
    target_forwards: int
    rounds: int
    draft_proposed: int
    draft_accepted: int
    prefix_survival: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def tau(self) -> float:
        return self.output_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.output_tokens if self.output_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "wall_time_s": self.wall_time_s, "output_tokens": self.output_tokens,
            "tokens_per_s": self.tokens_per_s, "target_forwards": self.target_forwards,
            "forwards_per_token": self.forwards_per_token, "rounds": self.rounds,
            "draft_proposed": self.draft_proposed, "draft_accepted": self.draft_accepted,
            "acceptance_rate": self.acceptance_rate, "tau": self.tau,
            "prefix_survival": self.prefix_survival,
        }


def make_policy(name: str, k: int, *, target=None, max_batch: int = 8) -> DraftLengthPolicy:
    """A draft-length policy by name, K = k drafts per round at most.

    prefix-scheduler profiles SPS(B) for `target` (a LoadedTarget) on first use per machine
    (cached under $DRAFTSMITH_HOME/profiles/), for up to `max_batch` rows of k + 1 tokens.
    """
    if name == "fixed":
        return FixedK(k)
    if name == "heuristic":
        return HeuristicK(initial=min(k, 16), max_k=max(16, k))
    if name == "threshold":
        from draftsmith.policy.threshold import ConfidenceThreshold

        return ConfidenceThreshold(max_k=k)
    if name == "batch-schedule":
        from draftsmith.policy.batch_schedule import BatchSizeSchedule, default_schedule

        return BatchSizeSchedule(default_schedule(k))
    if name == "prefix-scheduler":
        import sys

        from draftsmith.policy.prefix_scheduler import PrefixScheduler
        from draftsmith.policy.profile import ProfileConfig, load_or_profile

        if target is None:
            raise DraftsmithError(
                "the prefix-scheduler policy needs the target to profile SPS(B): call "
                "make_policy(name, k, target=loaded_target, max_batch=...) or pass "
                "PrefixScheduler(load_or_profile(model, ...)) as the policy"
            )
        sps = load_or_profile(
            target.model, weights_hash=target.weights_hash, name=target.target_id,
            config=ProfileConfig(max_batch=max_batch, max_k=k),
            log=lambda m: print(f"draftsmith: {m}", file=sys.stderr, flush=True),
        )
        return PrefixScheduler(sps, max_k=k)
    known = ("fixed", "heuristic", "threshold", "batch-schedule", "prefix-scheduler")
    raise DraftsmithError(f"unknown draft-length policy {name!r}; choose one of {', '.join(known)}")


class LLM:
    """A target (+ optional drafter) ready to generate.

    target:   built-in alias (e.g. "smollm2-135m"), a local HF-format directory, or an already
              loaded target (`LLM(...).target`; device / dtype then come from it).
    drafter:  "none", "ngram", "draft-model:PATH", or a Drafter instance.
    num_speculative_tokens / policy: draft length per round ("fixed" K or "heuristic").
    dtype:    "float32" (CPU default), "bfloat16" (CUDA default; on CPUs with AVX512-BF16 / AMX).
    threads:  CPU threads for torch's kernels (default: the physical cores).
    """

    def __init__(
        self,
        target: str | LoadedTarget = "smollm2-135m",
        drafter: str | Drafter = "none",
        num_speculative_tokens: int = 5,
        policy: str | DraftLengthPolicy = "fixed",
        max_batch: int = 8,
        max_len: int = 2048,
        device: str | None = None,
        dtype: str | None = None,
        threads: int | None = None,
    ) -> None:
        if isinstance(target, LoadedTarget):  # share one loaded target between several LLMs
            if threads is not None and target.model.device.type == "cpu":
                configure_threads(threads)
            self.target = target
        else:
            self.target = load_target(target, device=device, dtype=dtype, threads=threads)
        self.tokenizer = self.target.tokenizer
        cfg = EngineConfig(max_batch=max_batch, max_len=max_len)
        max_len = min(max_len, self.target.model.config.max_position_embeddings)
        self.drafter = drafter if not isinstance(drafter, str) else build_drafter(drafter, self.target, max_batch, max_len)
        self.policy = policy if not isinstance(policy, str) else make_policy(
            policy, num_speculative_tokens, target=self.target, max_batch=max_batch
        )
        self.engine = Engine(
            self.target.model, self.tokenizer, self.drafter, self.policy, cfg,
            eos_token_ids=eos_token_ids(self.target),
        )
        self.last_stats: GenerateStats | None = None

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise DraftsmithError(f"target {self.target.target_id!r} has no chat template; send plain prompts")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_chat_template: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise DraftsmithError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        encoded: list[tuple[list[int], SamplingParams]] = []
        texts: list[str | None] = []
        for p, sp in zip(prompts, plist):
            if isinstance(p, str):
                ids = self.apply_chat_template([{"role": "user", "content": p}]) if use_chat_template else self.encode(p)
                texts.append(p)
            else:
                ids = [int(t) for t in p]
                texts.append(None)
            encoded.append((ids, sp))
        for ids, sp in encoded:  # refuse before running anything, as the server (and vLLM) do
            self._check_context(len(ids), sp.max_tokens)
        seqs = [self.engine.add_request(ids, sp) for ids, sp in encoded]
        return self._run(seqs, texts)

    def _check_context(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.engine.max_len
        if prompt_len + max_tokens > limit:
            raise DraftsmithError(
                f"this model's context limit is {limit} tokens, but the prompt has {prompt_len} tokens and "
                f"max_tokens is {max_tokens} ({prompt_len + max_tokens} in all): "
                + (f"lower max_tokens to at most {limit - prompt_len}, " if prompt_len < limit else "")
                + "shorten the prompt, or raise max_len"
            )

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        ids = [self.apply_chat_template(list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params)

    def _run(self, seqs, texts) -> list[RequestOutput]:
        t0 = time.perf_counter()
        while any(not s.finished for s in seqs):
            self.engine.step()
        wall = time.perf_counter() - t0
        outs = [
            RequestOutput(
                request_id=s.request_id, prompt=t, prompt_token_ids=s.prompt_ids, text=s.text,
                token_ids=list(s.output_ids), finish_reason=s.finish_reason or "", stats=s.stats.to_dict(),
            )
            for s, t in zip(seqs, texts)
        ]
        surv_p: list[int] = []
        surv_a: list[int] = []
        for s in seqs:
            for k, (p, a) in enumerate(zip(s.stats.proposed_at, s.stats.accepted_at)):
                if k >= len(surv_p):
                    surv_p.append(0)
                    surv_a.append(0)
                surv_p[k] += p
                surv_a[k] += a
        self.last_stats = GenerateStats(
            wall_time_s=wall,
            output_tokens=sum(len(s.output_ids) for s in seqs),
            target_forwards=sum(s.stats.target_forwards for s in seqs),
            rounds=sum(s.stats.rounds for s in seqs),
            draft_proposed=sum(s.stats.proposed for s in seqs),
            draft_accepted=sum(s.stats.accepted for s in seqs),
            prefix_survival=[a / p if p else 0.0 for a, p in zip(surv_a, surv_p)],
        )
        return outs

"""The Python front door: `LLM(target, drafter=...).generate(prompts, SamplingParams(...))`.

Mirrors vLLM's offline API: a list of prompts in, a list of `RequestOutput` out (text,
token ids, finish reason) plus the speculative stats Draftsmith is about.
"""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from draftsmith.core.logprobs import TokenLogprobs, with_text
from draftsmith.core.sampling import SamplingParams, sample_seed
from draftsmith.drafters.base import Drafter, NoDrafter
from draftsmith.engine.builder import build_engine
from draftsmith.engine.speculative_config import with_speculative_config
from draftsmith.errors import DraftsmithError
from draftsmith.metrics import Metric, OfflineTotals
from draftsmith.models.generation_config import sampling_defaults
from draftsmith.models.loading import LoadedTarget
from draftsmith.models.prompts import encode_chat, encode_text
from draftsmith.models.target import load_target
from draftsmith.models.token_text import TokenText
from draftsmith.models.threads import configure_threads
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.registry import make_policy  # noqa: F401  (re-exported: draftsmith.api.make_policy)


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name): SamplingParams(n=N) gives N of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    # with SamplingParams(logprobs=k): per generated token {token id: Logprob}, the generated
    # token first, then the k most likely (core/logprobs.py); and the sum of the generated ones
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    # vLLM's: the stop_token_id (int) or stop string (str) that ended the sample; None for EOS or length
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """One prompt's result, shaped like vLLM's: `.outputs[i]` per sample, `.prompt_token_ids`.
    `.text`, `.token_ids`, `.finish_reason` and `.stats` are the first sample's (kept from
    Draftsmith's earlier API)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # with SamplingParams(prompt_logprobs=k): per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # vLLM's: prompt tokens whose KV came from the prefix cache (enable_prefix_caching)
    num_cached_tokens: int = 0
    finished: bool = True  # vLLM's (an offline generate returns finished requests only)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stats(self) -> dict:
        return self.outputs[0].stats


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
    forced_proposed: int = 0  # drafts the requests' grammars forced (core/grammar_drafts.py), not in draft_*
    forced_accepted: int = 0

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
            "forced_proposed": self.forced_proposed, "forced_accepted": self.forced_accepted,
        }


_TARGET, _MAX_BATCH, _MAX_LEN = "smollm2-135m", 8, 2048  # LLM's defaults (also _one_of's "not given")


def _one_of(ours: str, value: Any, default: Any, vllms: str, alias: Any) -> Any:
    """A setting given under Draftsmith's name or vLLM's (LLM(model=...) for target, ...): the one
    given; both (the ours not at its default) is an error."""
    if alias is None:
        return value
    if value != default:
        raise DraftsmithError(f"{ours} and {vllms} (vLLM's name for it) are both given; give one")
    return alias


def _token_ids(p: Any) -> list[int] | None:
    """`p` as a list of token ids where it is one (a sequence of ints, a numpy / torch vector),
    else None."""
    if hasattr(p, "tolist") and not isinstance(p, (list, tuple)):  # numpy / torch ids
        p = p.tolist()
    if isinstance(p, Seq) and not isinstance(p, (str, bytes)) and \
            all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p):
        return [int(t) for t in p]
    return None


def _prompt(p: Any, i: int) -> str | list[int]:
    """One prompt of `generate` as text or token ids: a string, a sequence of ints, or vLLM's
    TextPrompt / TokensPrompt dicts; anything else is a DraftsmithError that says what is taken."""
    if isinstance(p, Mapping):
        keys = set(p)
        if keys == {"prompt"}:
            if not isinstance(p["prompt"], str):
                raise DraftsmithError(f"prompt {i}: {{'prompt': ...}} takes a string, got {type(p['prompt']).__name__}")
            return p["prompt"]
        if keys == {"prompt_token_ids"}:
            if (ids := _token_ids(p["prompt_token_ids"])) is None:
                raise DraftsmithError(f"prompt {i}: prompt_token_ids takes a list of ints, got "
                                      f"{type(p['prompt_token_ids']).__name__}")
            return ids
        else:
            raise DraftsmithError(f"prompt {i}: a dict prompt is {{'prompt': str}} or {{'prompt_token_ids': [ints]}} "
                                  f"(vLLM's TextPrompt / TokensPrompt), got keys {sorted(map(str, keys))}"
                                  + ("; Draftsmith's targets take text only" if keys & {"multi_modal_data"} else ""))
    if isinstance(p, str):
        return p
    if (ids := _token_ids(p)) is not None:
        return ids
    raise DraftsmithError(f"prompt {i}: give a string, a list of token ids (ints) or vLLM's {{'prompt': ...}} / "
                          f"{{'prompt_token_ids': [...]}}, got {type(p).__name__} {str(p)[:60]}")


class LLM:
    """A target (+ optional drafter) ready to generate.

    target:   built-in alias (e.g. "smollm2-135m"), a local HF-format directory, or an already
              loaded target (`LLM(...).target`; device / dtype then come from it). vLLM's names
              work too: model= for target, max_model_len= for max_len, max_num_seqs= for max_batch.
    drafter:  "none", "ngram", "draft-model:PATH", or a Drafter instance.
    speculative_config: vLLM's (a dict or its JSON text), in place of drafter and K: e.g.
              {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4} or
              {"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}
              (engine/speculative_config.py says what is read and how it differs from vLLM).
    num_speculative_tokens / policy: drafts per round (K default: a trained drafter's block size,
              else 5): "auto" (default) = DSpark's prefix scheduler with at most K drafts (it
              verifies a draft only where its expected gain pays for the bigger forward on this
              machine; profiled once per machine), "fixed" = always K, or
              another registered policy (draftsmith.policy.registry).
    dtype:    "float32" (CPU default), "bfloat16" (CUDA default; on CPUs with AVX512-BF16 / AMX).
    drafter_dtype: what a trained or draft-model drafter computes in: "auto" (default: bfloat16
              beside a float32 target on CPUs whose kernels run bfloat16 fast, AVX-512 / AMX;
              else the target's dtype), "float32", "bfloat16", "float16". Outputs never depend
              on it (drafters/precision.py).
    threads:  CPU threads for torch's kernels. None (default): the physical cores, fewer while other
              processes keep some busy (re-checked every 2 s, models/threads.ThreadGovernor: beside a
              busy process every step would wait on a thread without a core); N: exactly N.
    reproducible_seeds: a seeded request gives one output whatever K, policy, batch or load
              (position-keyed coupling; acceptance of sampled drafts is lower than with the
              rejection rule, which False restores for seeded requests).
    enable_prefix_caching: a request reuses the KV of the longest prompt prefix a free cache row
              still holds (a shared system prompt, the conversation so far, a repeated prompt;
              engine/prefix_cache.py): plain decoding and every drafter (the trained ones keep
              their context per row with the KV; a custom drafter that reads target features
              without keeping them per row turns it off: True warns there, None turns it on
              quietly wherever it can). False (default): off. A reused prefix equals a fresh
              prefill up to float rounding, so outputs can differ from a run without it at
              near-ties (bfloat16 especially).
    forced_drafts: requests with structured outputs draft, for free, the tokens their grammar
              forces next (a JSON key, a regex's literal text), up to this many a round, and verify
              them like any draft: the output law is unchanged (greedy output too, up to float
              rounding at near-ties in the wider forward), a forced run the model follows commits
              in one forward (core/grammar_drafts.py). 0: off.
    generation_config: the sampling defaults of `generate` / `chat` without sampling params and of
              the server's requests, as vLLM's: "auto" (default) = the target's
              generation_config.json recommendation (temperature, top_p, top_k, min_p,
              repetition_penalty, max_new_tokens as max_tokens; e.g. Qwen2.5's T 0.7, top_p 0.8),
              "vllm" = none (SamplingParams' own defaults), or a directory holding a
              generation_config.json. override_generation_config: fields that replace it.
    """

    def __init__(
        self,
        target: str | LoadedTarget = _TARGET,
        drafter: str | Drafter = "none",
        num_speculative_tokens: int | None = None,
        policy: str | DraftLengthPolicy = "auto",
        max_batch: int = _MAX_BATCH,
        max_len: int = _MAX_LEN,
        device: str | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        reproducible_seeds: bool = True,
        drafter_dtype: str = "auto",
        enable_prefix_caching: bool | None = False,
        forced_drafts: int = 16,
        speculative_config: str | Mapping[str, Any] | None = None,
        generation_config: str = "auto",
        override_generation_config: Mapping[str, Any] | None = None,
        *,
        model: str | LoadedTarget | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        # vLLM's names for the same settings: LLM(model=..., max_model_len=..., max_num_seqs=...)
        target = _one_of("target", target, _TARGET, "model", model)
        max_len = _one_of("max_len", max_len, _MAX_LEN, "max_model_len", max_model_len)
        max_batch = _one_of("max_batch", max_batch, _MAX_BATCH, "max_num_seqs", max_num_seqs)
        drafter, num_speculative_tokens, policy, notes = with_speculative_config(
            speculative_config, drafter, num_speculative_tokens, policy)  # (checked before the target loads)
        for note in notes:
            print(f"draftsmith: warning: {note}", file=sys.stderr, flush=True)
        if isinstance(target, LoadedTarget):  # share one loaded target between several LLMs
            if threads is not None and target.model.device.type == "cpu":
                configure_threads(threads)
            self.target = target
        else:
            self.target = load_target(target, device=device, dtype=dtype, threads=threads)
        self.tokenizer = self.target.tokenizer
        # vLLM's get_diff_sampling_param: what a request leaves unset defaults to (models/generation_config.py)
        self.default_sampling: dict[str, Any] = sampling_defaults(self.target.path, generation_config,
                                                                  override_generation_config)
        self.engine = build_engine(self.target, drafter, policy, num_speculative_tokens, max_batch, max_len,
                                   reproducible_seeds=reproducible_seeds, drafter_dtype=drafter_dtype,
                                   enable_prefix_caching=enable_prefix_caching, adaptive_threads=threads is None,
                                   forced_drafts=forced_drafts)
        self.drafter, self.policy = self.engine.drafter, self.engine.policy
        self.num_speculative_tokens = num_speculative_tokens  # K: the most drafts a round verifies
        # the drafter as a spec ("ngram:prompt_lookup_min=2,...", "dspark:DIR"), or a Drafter object's name
        self.drafter_spec: str = (drafter if isinstance(drafter, str)
                                  else str(getattr(drafter, "name", type(drafter).__name__)))
        self.last_stats: GenerateStats | None = None
        self._totals = OfflineTotals()  # get_metrics(): since this LLM was made
        self._token_texts: TokenText | None = None  # logprobs' token texts (built on first use)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the target's recommended sampling (`generation_config`)
        where it has one, else SamplingParams' defaults; what generate / chat use without any."""
        d = dict(self.default_sampling)
        if not 0 < d.get("top_k", 0) < self.target.model.config.vocab_size:
            d.pop("top_k", None)  # -1, 0 or the whole vocabulary: all tokens (SamplingParams' default)
        return SamplingParams(**d)

    def get_metrics(self) -> list[Metric]:
        """vLLM's LLM.get_metrics(): counters since this LLM was made, under vLLM's names
        (prompt / generation tokens, finished requests, the spec_decode counters and the
        per-position acceptance Vector; draftsmith/metrics.py)."""
        k = 0 if isinstance(self.drafter, NoDrafter) else self.num_speculative_tokens
        return self._totals.metrics(self.target.target_id, k)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None, chat_template: str | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, self.target.target_id, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                           tools=tools, chat_template=chat_template)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return encode_text(self.tokenizer, prompt, add_special_tokens)

    def get_tokenizer(self):
        """vLLM's: the target's (HF) tokenizer."""
        return self.tokenizer

    def generate(
        self,
        prompts: str | Mapping[str, Any] | Seq[str | Mapping[str, Any] | Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_chat_template: bool = False,
        priority: Seq[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's LLM.generate: outputs in the prompts' order. A prompt is a string, a list of
        token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
        `priority` (vLLM's): one per prompt; where the prompts are more than max_batch rows,
        lower ones start first. `use_tqdm`: a bar of finished prompts (vLLM's), drawn only
        where stderr is a terminal."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and _token_ids(prompts)):
            prompts = [prompts]  # one prompt (a flat list of ints: its token ids, as vLLM reads it)
        prompts = [_prompt(p, i) for i, p in enumerate(prompts)]
        if not prompts:
            return []
        params = sampling_params or self.get_default_sampling_params()
        plist = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise DraftsmithError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        if len(prio) != len(prompts):
            raise DraftsmithError(f"{len(prio)} priorities for {len(prompts)} prompts")
        encoded: list[tuple[list[int], SamplingParams]] = []
        texts: list[str | None] = []
        for p, sp in zip(prompts, plist):
            if isinstance(p, str):
                ids = self.apply_chat_template([{"role": "user", "content": p}]) if use_chat_template else self.encode(p)
                texts.append(p)
            else:
                ids = p
                texts.append(None)
            if sp.truncate_prompt_tokens is not None:  # the prompt's last k tokens (vLLM's)
                ids = ids[-sp.truncate_prompt_tokens:]
            encoded.append((ids, sp))
        for ids, sp in encoded:  # refuse before running anything, as the server (and vLLM) do
            self._check_context(len(ids), sp.max_tokens)
        # n samples per prompt: sample i is seeded seed + i (as the server's choices; sample_seed),
        # so sample 0 is what n=1 gives
        groups = [[self.engine.add_request(ids, sp if i == 0 or sp.seed is None
                                           else replace(sp, seed=sample_seed(sp.seed, i, sp.n), n=1), priority=p)
                   for i in range(sp.n)] for (ids, sp), p in zip(encoded, prio)]
        return self._run(groups, texts, use_tqdm)

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
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several; the template's
        options as in apply_chat_template (e.g. continue_final_message=True with
        add_generation_prompt=False continues a started assistant message; `tools`: OpenAI tool
        definitions for a tool-aware template; `chat_template`: a Jinja template of your own)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        ids = [self.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                        continue_final_message=continue_final_message,
                                        chat_template_kwargs=chat_template_kwargs, tools=tools,
                                        chat_template=chat_template) for c in conversations]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)

    def _output(self, i: int, s) -> CompletionOutput:
        out = CompletionOutput(i, s.text, list(s.output_ids), s.finish_reason or "", s.stats.to_dict(),
                               stop_reason=s.stop_reason)
        if s.logprobs is not None:
            out.logprobs = with_text(s.logprobs, self._token_text)
            out.cumulative_logprob = sum(d[t].logprob for d, t in zip(s.logprobs, s.output_ids))
        return out

    def _token_text(self, token_id: int) -> str:
        if self._token_texts is None:
            self._token_texts = TokenText(self.tokenizer)
        return self._token_texts.text(token_id)

    def _run(self, groups, texts, use_tqdm: bool = False) -> list[RequestOutput]:
        seqs = [s for g in groups for s in g]
        t0 = time.perf_counter()
        bar = tqdm(total=len(groups), desc="Processed prompts", unit="prompt",
                   disable=not (use_tqdm and sys.stderr.isatty()))
        with bar:
            while any(not s.finished for s in seqs):
                self.engine.step()
                if not bar.disable:  # (a pass over the requests per step only where the bar is drawn)
                    bar.update(sum(all(s.finished for s in g) for g in groups) - bar.n)
        wall = time.perf_counter() - t0
        for s in seqs:  # (each sample its prompt, as vLLM counts its child requests)
            self._totals.add(len(s.prompt_ids), len(s.output_ids), s.finish_reason or "stop", s.stats)
        failed = next((s for s in seqs if s.finish_reason == "error"), None)
        if failed is not None:  # (a grammar the engine gave up on: the other requests ran to their end)
            raise DraftsmithError(f"request {failed.request_id}: {failed.error}")
        outs = [
            RequestOutput(
                request_id=g[0].request_id, prompt=t, prompt_token_ids=g[0].prompt_ids,
                outputs=[self._output(i, s) for i, s in enumerate(g)],
                prompt_logprobs=None if g[0].prompt_logprobs is None else
                [None] + with_text(g[0].prompt_logprobs[1:], self._token_text),
                num_cached_tokens=g[0].stats.cached_tokens,
            )
            for g, t in zip(groups, texts)
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
            forced_proposed=sum(s.stats.forced_proposed for s in seqs),
            forced_accepted=sum(s.stats.forced_accepted for s in seqs),
            prefix_survival=[a / p if p else 0.0 for a, p in zip(surv_a, surv_p)],
        )
        return outs

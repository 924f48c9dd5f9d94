"""The engine: continuous batching of speculative rounds over a row-batched KV cache.

    step() = admit + prefill waiting requests → propose → one target forward over
             [pending token, drafts] for every running row → verify → commit / stop.

Plain decoding is the same loop with a drafter that proposes nothing, so speculative and
plain outputs come from one code path. The engine never branches on drafter kind.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from draftsmith.core.grammar_drafts import fit_forced, forced_drafts, grammar_lengths, with_forced
from draftsmith.core.logprobs import token_logprobs
from draftsmith.core.penalties import penalize
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.stops import find_stop, stop_cut
from draftsmith.core.structured import Grammars, advance, grammar_bits, grammar_failure, masked, renew
from draftsmith.core.verify import verify, verify_greedy
from draftsmith.core.warp import argmax_rows, target_probs
from draftsmith.drafters.base import Drafter, NoDrafter, TargetFeatures
from draftsmith.core.request import Request, Status, StepInfo
from draftsmith.engine.prefix_cache import place
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.threads import ThreadGovernor
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.fixed import FixedK

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # KV cache rows = requests running at once
    max_len: int = 2048  # context limit per row (prompt + output)
    # Seeded requests verify by position-keyed coupling (core/verify.py): one seed, one output,
    # whatever K, policy, batch or load. False: the rejection rule for them too (higher
    # acceptance with sampled drafts; reproducible only while K does not depend on load).
    reproducible_seeds: bool = True
    # Automatic prefix caching (engine/prefix_cache.py): a new request reuses the KV of the longest
    # prompt prefix a free row still holds. With drafters that read no target features and those
    # that keep them per row (EAGLE-3, DFlash, DSpark): True asks for it (a warning where a drafter
    # rules it out), None = wherever the drafter allows.
    enable_prefix_caching: bool | None = False
    # On a CPU, leave the cores other busy processes use to them (models/threads.ThreadGovernor:
    # torch's threads re-decided every 2 s); False keeps the threads as they are set.
    adaptive_threads: bool = False
    # Requests with a grammar (structured outputs, forced tool calls): where it forces the next
    # tokens, up to this many are that row's draft for the round, verified like any other
    # (jump-forward that cannot change the output; core/grammar_drafts.py). 0: off.
    forced_drafts: int = 16

    def __post_init__(self) -> None:
        if type(self.forced_drafts) is not int or self.forced_drafts < 0:
            raise DraftsmithError(f"forced_drafts must be an integer >= 0 (0: off), got {self.forced_drafts!r}")


class Engine:
    def __init__(
        self,
        model: Decoder,
        tokenizer,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        config: EngineConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        cache: KVCache | None = None,
    ) -> None:
        """`cache`: share another engine's KV cache (engines that never run at the same time,
        e.g. a benchmark's configurations); it needs max_batch rows of max_len tokens."""
        self.model = model
        self.tokenizer = tokenizer
        self.drafter: Drafter = drafter or NoDrafter()
        self.policy: DraftLengthPolicy = policy or FixedK(0)
        self.config = config or EngineConfig()
        max_len = min(self.config.max_len, model.config.max_position_embeddings)
        self.max_len = max_len
        if cache is not None and (cache.max_rows < self.config.max_batch or cache.max_len < max_len):
            raise DraftsmithError(f"a shared KV cache of {cache.max_rows} rows x {cache.max_len} tokens is smaller "
                                  f"than this engine's {self.config.max_batch} x {max_len}")
        self.cache = cache if cache is not None else model.new_cache(self.config.max_batch, max_len)
        self.free_rows: list[int] = list(range(self.config.max_batch))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.eos_token_ids)  # compiled on first use
        self._ids = itertools.count()
        self.last_step = StepInfo()
        # wall seconds spent admitting requests (the target's prefill, the drafter's start), summed
        # since the engine was built: what a benchmark subtracts to see the decode phase alone
        self.prefill_s = 0.0
        needs = self.drafter.needs
        self._layer_ids = tuple(needs.layer_ids)
        for i in self._layer_ids:
            if not 0 <= i < model.config.num_layers:
                raise DraftsmithError(
                    f"drafter {self.drafter.name!r} needs target layer {i}, but the target has "
                    f"{model.config.num_layers} layers"
                )
        self.governor = (ThreadGovernor(torch.get_num_threads())
                         if self.config.adaptive_threads and model.device.type == "cpu" else None)
        # A reused prefix is not recomputed, so a drafter fed the target's features of every
        # context token cannot share it, unless it keeps them per row itself.
        asked = self.config.enable_prefix_caching
        reads = bool(needs.layer_ids or needs.final_hidden) and not needs.follows_prefix_cache
        self.prefix_caching = asked is not False and not reads
        # one that keeps them per row says which ids it holds there (drafters/feature_queue.py)
        self._drafter_held = getattr(self.drafter, "held_ids", None) if needs.follows_prefix_cache else None
        self._reuse_margin = needs.reuse_margin
        if asked is True and not self.prefix_caching:
            log.warning("prefix caching is off with drafter %r: it reads the target's features of every "
                        "prompt token, which a reused prefix does not recompute", self.drafter.name)

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        cache_salt: str | None = None, priority: int = 0,
    ) -> Request:
        """Queue a request. `cache_salt` (vLLM's): with prefix caching, it reuses KV only from
        requests with the same salt (engine/prefix_cache.py). `priority` (vLLM's): free rows go to
        waiting requests lowest priority first, in arrival order within one (running requests are
        never preempted)."""
        if not prompt_ids:
            raise DraftsmithError("prompt is empty: give at least one token")
        if type(priority) is not int:
            raise DraftsmithError(f"priority must be an integer (lower is admitted first), got {priority!r}")
        if params.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last k tokens (LLM does it first)
            prompt_ids = list(prompt_ids)[-params.truncate_prompt_tokens:]
        V = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise DraftsmithError(f"prompt token id {bad[0]} is outside the target vocabulary [0, {V})")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise DraftsmithError(f"{name}: token id {bad[0]} is outside the target vocabulary [0, {V})")
        if len(prompt_ids) >= self.max_len:
            raise DraftsmithError(
                f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_len}, "
                "which leaves no room to generate. Shorten the prompt"
            )
        bad_words_ids = self._bad_words_ids(params.bad_words)
        if params.allowed_token_ids is not None:  # what is left to generate must not be nothing
            left = set(params.allowed_token_ids) - {w[0] for w in bad_words_ids if len(w) == 1}
            if params.min_tokens:
                left -= set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if not left:
                raise DraftsmithError("allowed_token_ids leaves no token to generate once bad_words and min_tokens "
                                      "(which holds back EOS and the stop tokens) are applied")
        grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(params.seed)
        seq = Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            generator=gen,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            grammar=grammar,
            bad_words_ids=bad_words_ids,
            cache_salt=cache_salt,
            priority=priority,
        )
        self.waiting.append(seq)
        return seq

    def _bad_words_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (vLLM's two spellings), once each."""
        seqs: list[list[int]] = []
        V = self.model.config.vocab_size
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if any(not 0 <= t < V for t in ids):
                    raise DraftsmithError(f"bad_words: {w!r} tokenizes to ids outside the target vocabulary [0, {V})")
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its cache row is freed at once."""
        for s in list(self.waiting):
            if s.request_id == request_id:
                self.waiting.remove(s)
                self._finish(s, "abort")
                return True
        for s in self.running:
            if s.request_id == request_id:
                self._finish(s, "abort")
                self.running.remove(s)
                return True
        return False

    def abort_all(self) -> list[Request]:
        """Cancel everything (e.g. after a failed step); all cache rows are freed."""
        victims = list(self.waiting) + list(self.running)
        self.waiting.clear()
        for s in victims:
            self._finish(s, "abort")
        self.running = []
        return victims

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def rows_in_use(self) -> int:
        return self.config.max_batch - len(self.free_rows)

    # ---- the loop ---------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One round for every running request. Returns the sequences that finished."""
        if self.governor is not None:
            self.governor.step()
        self._admit()
        if not self.running:
            return []
        seqs = list(self.running)
        finished = self._round(seqs)
        self.running = [s for s in self.running if not s.finished]
        return finished

    def _admit(self) -> None:
        new: list[Request] = []
        if self.free_rows and any(s.priority for s in self.waiting):  # (stable: arrival order within a priority)
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.priority))
        while self.waiting and len(new) < len(self.free_rows):
            new.append(self.waiting.popleft())
        if not new:
            return
        t_admit = time.perf_counter()
        # Prefill everything but the last prompt token (it is the first round's input), in
        # groups of similar length: one padded forward per group, so no row computes much
        # padding (one batch padded to its longest prompt spent most of regen's time on it).
        # With prefix caching a row starts after the prefix it already holds.
        feeds = [s.prompt_ids[:-1] for s in new]
        if self.prefix_caching:
            # (a request that asks for its prompt's logprobs prefills all of it: no reuse)
            placed = [(r, 0 if s.prompt_logprobs is not None else max(0, n - self._reuse_margin))
                      for s, (r, n) in zip(new, place(feeds, self.free_rows, self.cache, self._drafter_held,
                                                      [s.cache_salt for s in new]))]
        else:
            placed = [(r, 0) for r in self.free_rows[: len(new)]]
        now = time.perf_counter()
        for s, (row, reused) in zip(new, placed):
            s.row = row
            s.status = Status.RUNNING
            s.stats.t_scheduled = now
            self.free_rows.remove(row)
            if self.prefix_caching:
                self.cache.reuse(row, reused)
            else:
                self.cache.reset(row)
            s.stats.cached_tokens = reused
        starts = [r for _, r in placed]
        todo = [len(f) - r for f, r in zip(feeds, starts)]
        for group in prefill_groups(todo, room=[self.max_len - r for r in starts]):
            features = None
            if todo[group[0]]:
                S = todo[group[-1]]
                ids = torch.zeros(len(group), S, dtype=torch.long)
                for b, i in enumerate(group):
                    ids[b, : todo[i]] = torch.tensor(feeds[i][starts[i]:], dtype=torch.long)
                rows = torch.tensor([new[i].row for i in group])
                out = self.model(ids, self.cache, rows=rows, layer_ids=self._layer_ids, compute_logits=False)
                features = self._features(out)
                for i in group:
                    new[i].stats.target_forwards += 1
            for b, i in enumerate(group):
                s = new[i]
                if s.prompt_logprobs is not None and todo[i]:  # row p's logits score prompt token p + 1
                    s.prompt_logprobs += self._score(out.final_hidden[b, : todo[i]], s.prompt_ids[1:],
                                                     s.params.prompt_logprobs)
                self.cache.lengths[s.row] = len(feeds[i])
                self.drafter.start(s, _slice_features(features, b, todo[i]))
        self.running.extend(new)
        self.running.sort(key=lambda s: s.row)  # consecutive rows: attention reads cache views
        if self.model.device.type == "cuda":  # (the prefill's kernels, not only their launch)
            torch.cuda.synchronize(self.model.device)
        self.prefill_s += time.perf_counter() - t_admit

    def _score(self, final_hidden: torch.Tensor, tokens: list[int], k: int, chunk: int = 256) -> list:
        """Logprobs of `tokens` from the normed final states [n, H] that predicted them, the
        49k-wide logits computed `chunk` positions at a time."""
        out = []
        for a in range(0, len(tokens), chunk):
            out += token_logprobs(self.model.logits_from(final_hidden[a: a + chunk]), tokens[a: a + chunk], k)
        return out

    def _features(self, out) -> TargetFeatures | None:
        needs = self.drafter.needs
        if not needs.layer_ids and not needs.final_hidden:
            return None
        return TargetFeatures(
            hidden=out.hidden, final_hidden=out.final_hidden if needs.final_hidden else None
        )

    def _round(self, seqs: list[Request]) -> list[Request]:
        # Cap each row's draft so that (a) max_tokens is never exceeded even if every draft
        # and the bonus are accepted, (b) the cache has room for pending + drafts — for every
        # row: the forward pads all rows to the widest block, so a row near its context limit
        # bounds the drafts of the whole batch for its last rounds.
        t0 = time.perf_counter()
        consumed0 = getattr(self.drafter, "consumed_s", 0.0)  # context features consumed: not drafting time
        positions0 = getattr(self.drafter, "consumed_positions", 0)
        # A policy that prices the drafter's queued context features (a probe consumes its rows' backlog
        # first: policy/prefix_scheduler.py) hears how many these rows hold.
        queued, backlog = getattr(self.policy, "queued", None), getattr(self.drafter, "backlog_positions", None)
        if queued is not None and backlog is not None:
            queued(backlog(seqs))
        wanted = self.policy.choose(seqs)
        room = min(self.max_len - s.num_tokens for s in seqs)
        caps = [0 if s.grammar_renewals else max(0, min(k, s.remaining - 1, room)) for k, s in zip(wanted, seqs)]
        # Rows whose grammar forces the next tokens draft those instead (core/grammar_drafts.py;
        # the grammar's work is not drafting time).
        tg = time.perf_counter()
        forced = (forced_drafts(seqs, [0 if s.grammar_renewals else min(self.config.forced_drafts, s.remaining - 1, room)
                                       for s in seqs])
                  if self.config.forced_drafts > 0 else [])
        if gave_up := self._renew(seqs):  # (reading what a grammar forces can hit the engine's limits too)
            forced = [[] if b in gave_up else f for b, f in enumerate(forced)]
        grammar_s = time.perf_counter() - tg
        if any(forced):
            caps = [0 if f else c for f, c in zip(forced, caps)]
        # A policy that decides column by column can let a drafter that supports it stop at the
        # first column that will not be verified (policy/prefix_scheduler.py, draft_gate).
        draft_gate = getattr(self.policy, "draft_gate", None)
        gate = draft_gate(seqs, caps) if draft_gate is not None and getattr(self.drafter, "gated", False) else None
        proposal = self.drafter.propose(seqs, caps, gate=gate) if gate is not None else self.drafter.propose(seqs, caps)
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        for b, (n, cap) in enumerate(zip(lengths, caps)):
            if n > cap:
                raise RuntimeError(f"drafter {self.drafter.name} proposed {n} > cap {cap} tokens")
        self._check_vocabulary(proposal)
        keep = self.policy.trim(seqs, proposal)
        if keep != lengths:
            if any(not 0 <= k <= n for k, n in zip(keep, lengths)):
                raise RuntimeError(f"policy {self.policy.name} kept {keep} of {lengths} drafts")
            proposal = proposal.truncated(keep)  # only kept drafts go through the target
        # What the drafter and the policy decided: the policy learns from it (a draft cut below
        # because the grammar refuses it counts as rejected, which it certainly is).
        drafted_view = proposal
        tg = time.perf_counter()
        # Drafts the grammar refuses are rejected for certain: not verified (core/grammar_drafts.py).
        # A row whose grammar engine gave up on a draft (drafting inside the grammar, or checking it
        # here) goes on from a fresh matcher at its output, without drafts this round.
        if any(s.grammar is not None for s in seqs):
            cut = grammar_lengths(seqs, proposal, self.eos_token_ids)
            for b in self._renew(seqs):
                cut[b] = 0
            proposal = proposal.truncated(cut)
        if any(forced):  # as many as the wider forward pays for (the policy's cost model, else fit_forced)
            kept = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
            wants = [len(f) for f in forced]
            plan = getattr(self.policy, "forced_lengths", None)
            fit = (plan(seqs, kept, wants) if plan is not None
                   else fit_forced(len(seqs), kept, wants))
            if any(not 0 <= k <= n for k, n in zip(fit, wants)):
                raise RuntimeError(f"policy {self.policy.name} kept {fit} of {wants} forced drafts")
            forced = [f[:k] for f, k in zip(forced, fit)]
            proposal = with_forced(proposal, forced)
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        # structured outputs: position j masked by the grammar after drafts < j (core/structured.py),
        # read before the forward: where the grammar engine gives up on a row's drafts, the row
        # renews its matcher and is verified without them. (Their time counts as the forward's, as
        # when they were read after it: the policy's cost model sees what a wider block costs.)
        tm = time.perf_counter()
        bits, failed = grammar_bits(seqs, proposal.tokens if proposal.max_len else None, lengths,
                                    self.model.config.vocab_size, self.grammars.executor)
        if failed:
            gave_up = self._renew(seqs)
            forced = [[] if b in gave_up else f for b, f in enumerate(forced)]
            proposal = proposal.truncated([0 if b in gave_up else n for b, n in enumerate(lengths)])
            lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
            # Only the renewed rows' masks are read again (position 0, from the fresh matcher): the
            # other rows' masks stand. (Read again, a row's matcher that did not give up the first
            # time may give up now, llguidance counting the lexer's work over a matcher's life: that
            # row would end with "error" without ever being renewed.)
            bits = bits[:, : 1 + proposal.max_len].clone()
            again, failed = grammar_bits([seqs[b] for b in gave_up], None, [0] * len(gave_up),
                                         self.model.config.vocab_size, self.grammars.executor)
            for i, b in enumerate(gave_up):
                bits[b] = -1
                if again is not None:
                    bits[b, 0] = again[i, 0]
            for i in failed:  # past the limits at its own output, without drafts: the request ends
                seqs[gave_up[i]].error = seqs[gave_up[i]].error or grammar_failure(seqs[gave_up[i]])
        K = proposal.max_len
        drafted = any(c > 0 for c in caps)
        t1 = time.perf_counter()
        mask_s = t1 - tm
        grammar_s += tm - tg
        consumed_s = getattr(self.drafter, "consumed_s", 0.0) - consumed0
        draft_s = max(0.0, t1 - t0 - grammar_s - mask_s - consumed_s)
        consumed_positions = getattr(self.drafter, "consumed_positions", 0) - positions0
        ids = torch.zeros(len(seqs), 1 + K, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, 0] = s.all_ids[-1]
        if K:
            ids[:, 1:] = proposal.tokens
        rows = torch.tensor([s.row for s in seqs])
        out = self.model(ids, self.cache, rows=rows, layer_ids=self._layer_ids)
        # penalties, logit_bias, min_tokens, allowed_token_ids, bad_words: position j after drafts < j
        # (core/penalties.py)
        logits = penalize(out.logits, seqs, proposal.tokens if K else None, tuple(self.eos_token_ids))
        if bits is not None:  # the grammar masks (in place where no one reads the unmasked logits: a
            # copy of penalize's, or no logprobs asked)
            logits = masked(logits, bits, inplace=logits is not out.logits or all(s.logprobs is None for s in seqs))
        if all(s.params.greedy for s in seqs):  # p one-hot at the argmax: the argmax is all verify needs
            V = logits.shape[-1]
            result = verify_greedy(proposal, argmax_rows(logits.reshape(-1, V)).view(len(seqs), 1 + K), V)
        else:
            p = target_probs(logits, [s.params for s in seqs])  # [B, 1+K, V]
            # seeded requests: position-keyed coupling, so the output never depends on K or load
            keys = [(s.params.seed, len(s.output_ids)) if s.params.seed is not None and self.config.reproducible_seeds
                    else None for s in seqs]
            result = verify(proposal, p, [s.generator for s in seqs], keys)
        finished: list[Request] = []
        committed_tokens = result.tokens.tolist()  # waits for the device: timings end here
        self.last_step = StepInfo(rows=len(seqs), block_len=1 + K, useful_tokens=len(seqs) + sum(lengths),
                                  drafted=drafted, forward_s=time.perf_counter() - t1 + mask_s,
                                  draft_s=draft_s, consumed_s=consumed_s, consumed_positions=consumed_positions,
                                  # a round with forced drafts says nothing about the drafter's gain
                                  accepted=None if any(forced) else int(result.num_accepted.sum()) if K else 0)
        for b, s in enumerate(seqs):
            m = int(result.num_accepted[b])
            if s.error is not None:  # its grammar is past the limits at its output: nothing of the row is kept
                s.finish_reason = "error"
                continue
            # KV of the pending token and the m accepted drafts is now committed;
            # entries past it (rejected drafts) are stale and get overwritten.
            self.cache.lengths[s.row] += 1 + m
            s.stats.target_forwards += 1
            appended = self._append(s, committed_tokens[b][: m + 1])
            kept = s.output_ids[len(s.output_ids) - appended:]
            advance(s, kept)  # the request's grammar follows its output (core/structured.py)
            if s.error is not None and not self._renew_one(s):  # (gave up taking them, afresh too)
                s.finish_reason = "error"
            if s.logprobs is not None:  # the target's rows of the committed tokens (core/logprobs.py)
                s.logprobs += token_logprobs(out.logits[b], kept, s.params.logprobs)
            if forced and forced[b]:  # the grammar's drafts, not the drafter's
                s.stats.record_round(proposed=0, accepted=0, committed=appended)
                s.stats.record_forced(proposed=lengths[b], accepted=m)
            else:
                s.stats.record_round(proposed=lengths[b], accepted=m, committed=appended)
        self.drafter.on_verified(seqs, proposal, result, self._features(out))
        if any(forced):  # forced rows proposed nothing of the drafter's: nothing of theirs was accepted
            result = replace(result, num_accepted=torch.tensor(
                [0 if f else int(m) for f, m in zip(forced, result.num_accepted.tolist())], dtype=torch.long))
        self.policy.update(seqs, drafted_view, result)
        observe = getattr(self.policy, "observe", None)  # optional: policies that learn step cost
        if observe is not None:
            observe(self.last_step)
        for s in seqs:
            if s.finish_reason is not None and not s.finished:
                self._finish(s, s.finish_reason)
                finished.append(s)
        return finished

    def _check_vocabulary(self, proposal) -> None:
        """A drafter's token ids must be the target's (before anything, the grammar included, reads them)."""
        if not proposal.max_len:
            return
        V = self.model.config.vocab_size
        valid = torch.arange(proposal.max_len, device=proposal.tokens.device)[None, :] < proposal.lengths[:, None]
        bad = proposal.tokens[valid]
        bad = bad[(bad < 0) | (bad >= V)]
        if bad.numel():
            raise DraftsmithError(
                f"drafter {self.drafter.name!r} proposed token id {int(bad[0])}, outside the "
                f"target vocabulary [0, {V}); the drafter does not match this target"
            )

    def _append(self, s: Request, tokens: list[int]) -> int:
        """Commit tokens one by one, applying stop rules; returns how many were kept."""
        p = s.params
        kept = 0
        for t in tokens:
            s.output_ids.append(t)
            kept += 1
            if s.stats.t_first_token is None:
                s.stats.t_first_token = time.perf_counter()
            eos = not p.ignore_eos and t in self.eos_token_ids
            if eos or t in p.stop_token_ids:
                s.finish_reason, s.stopped_by_token, s.stop_reason = "stop", True, None if eos else t
                break
            if p.stop and len(s.output_ids) >= p.min_tokens and (hit := self._stop_string_ends(s)) is not None:
                s.finish_reason, s.stop_reason = "stop", hit
                break
            if len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_len:
                s.finish_reason = "length"
                break
        if kept:
            s.stats.t_last_token = time.perf_counter()
        return kept

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                     spaces_between_special_tokens=spaces_between_special_tokens)

    def _text(self, ids: list[int], p) -> str:
        """`ids` decoded as request params `p` ask (vLLM's skip_special_tokens / spaces_between_special_tokens)."""
        return self.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens)

    def _stop_string_ends(self, s: Request) -> str | None:
        """The stop string the output now holds, ending past the first min_tokens - 1 tokens' text; or None."""
        p = s.params
        window = max(len(x) for x in p.stop) + 8
        if len(s.output_ids) - window >= p.min_tokens - 1:  # only the tail can complete a new one: decode a window
            text, after = self._text(s.output_ids[-window:], p), 0
        else:
            text, after = self._text(s.output_ids, p), self.stop_floor(s)
        hit = find_stop(text, p.stop, after)
        return None if hit is None else text[hit[0]: hit[1]]

    def stop_floor(self, s: Request) -> int:
        """Characters of output text a stop string must end past: the text of the tokens before
        min_tokens (vLLM looks for stop strings only from there on)."""
        p = s.params
        return len(self._text(s.output_ids[: p.min_tokens - 1], p)) if p.min_tokens > 1 else 0

    def _renew(self, seqs: list[Request]) -> list[int]:
        """The rows whose grammar engine gave up (on drafts, or reading what the grammar forces),
        each given a fresh matcher at its committed output (core/structured.renew; where the
        output itself is past the limits, the request's `error` is set and it ends this round)."""
        rows = [b for b, s in enumerate(seqs) if s.error is None and grammar_failure(s) is not None]
        for b in rows:
            self._renew_one(seqs[b])
        return rows

    def _renew_one(self, s: Request) -> bool:
        """`s`'s grammar engine gave up: a fresh matcher at its output (core/structured.renew), and
        the request drafts no more (drafts make the engine explore more; plain steps cost it the
        least). Refused, with `error` set, once renewals outpace the output (more than 2 + one per
        64 tokens: a grammar past the engine's limits at nearly every token would stall the whole
        batch with a fresh compile and mask every round)."""
        s.grammar_renewals += 1
        if s.grammar_renewals > 2 + len(s.output_ids) // 64:
            s.error = s.error or grammar_failure(s)
            return False
        return renew(s, self.grammars)

    def visible_text(self, s: Request) -> str:
        """Decoded output (special tokens dropped unless the request keeps them) up to the first
        stop string (through it with include_stop_str_in_output); the stop token that ended it is
        not part of the text unless include_stop_str_in_output, as in vLLM."""
        p = s.params
        ids = s.output_ids[:-1] if s.stopped_by_token and not p.include_stop_str_in_output else s.output_ids
        text = self._text(ids, p)
        cut = stop_cut(text, p.stop, p.include_stop_str_in_output, self.stop_floor(s)) if p.stop else None
        return text if cut is None else text[:cut]

    def _finish(self, s: Request, reason: str) -> None:
        s.finish_reason = reason
        if reason == "error" and s.params.structured_outputs is not None:
            self.grammars.forget(s.params.structured_outputs)  # (its copies share what failed)
        s.text = self.visible_text(s) if s.params.detokenize else ""
        s.status = Status.FINISHED
        s.stats.t_finish = time.perf_counter()
        if s.row >= 0:
            self.drafter.release(s)
            if self.prefix_caching and reason not in ("abort", "error"):
                # The row's KV holds the tokens fed so far: all_ids but the pending last one (and
                # none past a stop rule's cut, where accepted drafts were fed but not kept).
                ids = s.all_ids
                self.cache.remember(s.row, ids[: min(int(self.cache.lengths[s.row]), len(ids))], s.cache_salt)
            else:
                self.cache.reset(s.row)
            self.free_rows.append(s.row)
            self.free_rows.sort()
            s.row = -1


def prefill_groups(lengths: list[int], max_waste: float = 0.1, room: list[int] | None = None) -> list[list[int]]:
    """Indices grouped for padded prefill, shortest first: a group grows while its padded
    size (rows x longest) stays within (1 + max_waste) x the tokens it really holds, and
    (`room`: how many positions each row has left, where rows start at different lengths)
    while the padded width fits every row in it. Empty prompts form their own group (no forward)."""
    groups: list[list[int]] = []
    total = 0  # tokens in the last group (its longest prompt is the one being added: sorted)
    fits = 0  # the least room of a row in the last group
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        r = room[i] if room is not None else 1 << 62  # no bound without `room`
        # (zeros only ever join zeros: a prompt of n > 0 would pad a group of k >= 1 empties to (k+1)n)
        if groups and (len(groups[-1]) + 1) * n <= (1 + max_waste) * (total + n) and n <= fits:
            groups[-1].append(i)
            total += n
            fits = min(fits, r)
        else:
            groups.append([i])
            total, fits = n, r
    return groups


def _slice_features(f: TargetFeatures | None, b: int, n: int) -> TargetFeatures | None:
    if f is None:
        return None
    return TargetFeatures(
        hidden={k: v[b : b + 1, :n] for k, v in f.hidden.items()},
        final_hidden=None if f.final_hidden is None else f.final_hidden[b : b + 1, :n],
    )

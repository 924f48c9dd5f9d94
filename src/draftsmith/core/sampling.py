"""Sampling parameters: the knobs that define the target distribution p.

Temperature, top-k, top-p and min-p warp the target's logits into p. Temperature 0 means
greedy: p is one-hot at the argmax, and the same verifier code handles it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.core.logprobs import MAX_LOGPROBS
from draftsmith.core.structured import StructuredOutputsParams
from draftsmith.errors import DraftsmithError


def sample_seed(seed: int, i: int, n: int) -> int:
    """Sample i's seed of a request seeded `seed` with n samples: seed + i, except where that is -1
    (no seed, to SamplingParams and vLLM): seed + n then, a seed none of the n samples uses."""
    return seed + n if seed + i == -1 else seed + i


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (names follow vLLM / the OpenAI API).

    max_tokens:      maximum number of new tokens (exact: never exceeded).
    temperature:     0 = greedy; > 0 scales logits by 1/temperature.
    top_p:           nucleus mass in (0, 1]; 1 disables.
    top_k:           keep the k most likely tokens; 0 disables.
    min_p:           drop tokens with prob < min_p * max prob; 0 disables.
    seed:            per-request generator seed; None (or -1, as vLLM's) = nondeterministic.
    stop:            stop strings; the output ends right before the first occurrence (right
                     after it with include_stop_str_in_output).
    stop_token_ids:  extra token ids that end the output (EOS is always one unless ignore_eos).
    ignore_eos:      keep generating past EOS (benchmarks).
    skip_special_tokens: drop special tokens (EOS, chat markers) from the text (vLLM's default).
    spaces_between_special_tokens: vLLM's, passed to the tokenizer's decode; transformers 5's
                     tokenizers ignore it (as vLLM's fast detokenizer does): taken for vLLM's API.
    detokenize:      False: no text (`.text` is ""), token ids only (vLLM's; not with stop strings).
    extra_args:      vLLM's free-form dict for extensions, kept as given (nothing in Draftsmith reads it).
    truncate_prompt_tokens: keep only the prompt's last k tokens (vLLM's; None = all).
    n:               samples per prompt (`LLM.generate`: RequestOutput.outputs; sample i is
                     seeded seed + i when a seed is given).
    logprobs:        None = none; k in 0..20 = every generated token's log probability under
                     the target (raw: before temperature and the other warps) and its k most
                     likely alternatives (core/logprobs.py; `CompletionOutput.logprobs`).
    repetition_penalty / frequency_penalty / presence_penalty: vLLM's and OpenAI's penalties
                     (1 / 0 / 0 = off; core/penalties.py), applied per position of a verify
                     block, so speculative decoding keeps the penalised distribution exactly.
    logit_bias:      {token id: bias in [-100, 100]} added to the raw logits (OpenAI's).
    allowed_token_ids: only these tokens may be generated (vLLM's; EOS only if listed).
    bad_words:       strings the output may not contain as tokens (vLLM's: each word tokenized
                     alone and after a space; its last token is banned where the output so far
                     ends with the rest).
    min_tokens:      no end of sequence (EOS, stop_token_ids, stop strings) before this many
                     tokens (vLLM's; <= max_tokens).
    structured_outputs: a StructuredOutputsParams (JSON schema, regex, choice, Lark grammar,
                     JSON object) every generated token must keep to (core/structured.py); the
                     output ends at the grammar's end. Not with min_tokens, ignore_eos,
                     allowed_token_ids or bad_words.
    prompt_logprobs: the same for the prompt's tokens (`RequestOutput.prompt_logprobs`: None for
                     the first token, which nothing predicts); the request then reuses no cached prefix.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise DraftsmithError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise DraftsmithError(f"n must be a positive integer (samples per prompt), got {self.n!r}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -2**63 <= self.seed < 2**63:
                raise DraftsmithError(f"seed must be None or an integer in [-2**63, 2**63 - 1] (-1: no seed), "
                                      f"got {self.seed!r}")
            if self.seed == -1:  # vLLM's: no seed
                object.__setattr__(self, "seed", None)
            elif self.seed + self.n - 1 >= 2**63:  # (n is checked above)
                raise DraftsmithError(f"seed + n - 1 must be below 2**63 (sample i uses seed + i), got seed "
                                      f"{self.seed} with n={self.n}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise DraftsmithError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise DraftsmithError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DraftsmithError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise DraftsmithError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            try:
                bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise DraftsmithError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
            off = [(t, b) for t, b in bias.items() if not -100.0 <= b <= 100.0]
            if off:
                raise DraftsmithError(f"logit_bias values must be in [-100, 100], got {off[0][1]!r} for token {off[0][0]}")
            object.__setattr__(self, "logit_bias", bias or None)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise DraftsmithError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                                  f"got {self.min_tokens!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids) \
                    or not ids:
                raise DraftsmithError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))
        if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w for w in self.bad_words):
            raise DraftsmithError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if not (0.0 < self.repetition_penalty < float("inf")):  # also rejects NaN
            raise DraftsmithError(f"repetition_penalty must be a positive number (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise DraftsmithError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise DraftsmithError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many top "
                                      f"tokens to return beside each {'generated' if name == 'logprobs' else 'prompt'}"
                                      f" token), got {k!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise DraftsmithError(f"truncate_prompt_tokens must be None or a positive integer (keep the prompt's "
                                  f"last k tokens), got {k!r}")
        if any(not s for s in self.stop):
            raise DraftsmithError("stop strings must be non-empty")
        if not self.detokenize and self.stop:
            raise DraftsmithError("stop strings need the text: give detokenize=True, or stop_token_ids instead")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise DraftsmithError(f"extra_args must be a dict (or None), got {type(self.extra_args).__name__}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise DraftsmithError("structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}")
            for name in ("allowed_token_ids", "bad_words"):  # with a grammar they could leave no token at all
                if getattr(self, name):
                    raise DraftsmithError(f"{name} cannot be combined with structured outputs: the grammar decides "
                                          "which tokens may come (write the restriction into it)")
            if self.ignore_eos or self.min_tokens:
                raise DraftsmithError(f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined with "
                                      "structured outputs: the output ends where the grammar ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""A request's sampling fields, checked and turned into one `SamplingParams` per choice.

Ranges the server enforces beyond SamplingParams: temperature finite in [0, 2] (OpenAI's
range); seed in vLLM's int64 range [-2**63, 2**63 - 1], -1 meaning no seed as in vLLM's
SamplingParams (choice i uses seed + i, core/sampling.sample_seed, so seed + n - 1 must fit too;
a generator maps a negative seed to its unsigned 64 bits); top_k -1 or 0 = all tokens, and a
top_k at or above the vocabulary size keeps all tokens too (as vLLM); stop_token_ids inside the
vocabulary; logit_bias values clamped to [-100, 100], as vLLM's SamplingParams.from_optional.
"""

from __future__ import annotations

from typing import Any, Mapping

from draftsmith.core.sampling import SamplingParams, sample_seed
from draftsmith.core.structured import StructuredOutputsParams
from draftsmith.errors import DraftsmithError
from draftsmith.server.protocol import APIError

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "repetition_penalty",
                    "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "ignore_eos",
                    "allowed_token_ids", "bad_words")
_MAX_TEMPERATURE = 2.0
_MAX_SEED = 2**63 - 1
_MIN_SEED = -(2**63)
_MAX_BIAS = 100.0


def check_sampling(req: Any, vocab_size: int) -> None:
    """The ranges SamplingParams accepts but the server does not (see the module docstring)."""
    t = req.temperature
    if t is not None and not 0.0 <= t <= _MAX_TEMPERATURE:  # NaN and infinity fail too
        raise APIError(400, f"temperature must be a number in [0, {_MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}",
                       param="temperature", code="invalid_value")
    if seed_of(req) is not None and not _MIN_SEED <= req.seed <= _MAX_SEED - (req.n - 1):
        msg = "seed must be an integer in [-2**63, 2**63 - 1] (-1: no seed)"
        if req.n > 1:
            msg += f"; choice i uses seed + i, so with n={req.n} it must be at most {_MAX_SEED - req.n + 1}"
        raise APIError(400, f"{msg}, got {req.seed}", param="seed", code="invalid_value")
    if req.top_k is not None and req.top_k < -1:
        raise APIError(400, f"top_k must be -1 or 0 (all tokens) or a positive integer, got {req.top_k}",
                       param="top_k", code="invalid_value")
    req.top_logprobs_k()  # its range (and chat's top_logprobs without logprobs)
    for name, ids in (("logit_bias", logit_bias(req)), ("stop_token_ids", req.stop_token_ids),
                      ("allowed_token_ids", req.allowed_token_ids)):
        bad = [t for t in ids or () if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param=name, code="invalid_value")


def seed_of(req: Any) -> int | None:
    """The request's seed; -1 is none (vLLM's SamplingParams.__post_init__)."""
    return None if req.seed == -1 else req.seed


def logit_bias(req: Any) -> dict[int, float] | None:
    """The request's logit_bias with token ids as integers (JSON keys are strings), each bias
    clamped to [-100, 100] (vLLM's SamplingParams.from_optional)."""
    if not req.logit_bias:
        return None
    try:
        return {int(k): min(_MAX_BIAS, max(-_MAX_BIAS, float(v))) for k, v in req.logit_bias.items()}
    except (TypeError, ValueError):
        raise APIError(400, "logit_bias must map token ids (as strings, e.g. \"50256\") to numbers (clamped to "
                       "[-100, 100])", param="logit_bias", code="invalid_value") from None


def sampling_params(req: Any, max_tokens: int | None, prompt_len: int, index: int, prompt_param: str, *,
                    max_len: int, vocab_size: int, structured: StructuredOutputsParams | None = None,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """Choice `index`'s SamplingParams; max_tokens None: up to the context length; `structured`:
    the request's grammar (`structured_outputs`); `defaults`: what a field the request leaves
    unset takes (LLM.default_sampling: the target's generation config, as vLLM), its max_tokens
    a cap on any request's (vLLM's get_max_tokens)."""
    d = defaults or {}
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty: give at least one token", param=prompt_param)
    if prompt_len >= max_len:
        raise APIError(
            400, f"This model's maximum context length is {max_len} tokens, but the prompt has "
            f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = max_len - prompt_len
    if max_tokens <= 0:
        hint = " (0 only with echo: true: the prompt alone, with its logprobs if asked)" if hasattr(req, "echo") else ""
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}{hint}", param="max_tokens",
                       code="invalid_value")
    if prompt_len + max_tokens > max_len:
        raise APIError(
            400, f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    max_tokens = min(max_tokens, d.get("max_tokens", max_tokens))
    top_k = d.get("top_k", 0) if req.top_k is None else req.top_k
    stop = req.stop if req.stop is not None else ()
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.get("temperature", 1.0) if req.temperature is None else float(req.temperature),
            top_p=d.get("top_p", 1.0) if req.top_p is None else float(req.top_p),
            top_k=top_k if 0 < top_k < vocab_size else 0,  # -1, 0 or the whole vocabulary: all tokens
            min_p=d.get("min_p", 0.0) if req.min_p is None else float(req.min_p),
            seed=None if seed_of(req) is None else sample_seed(req.seed, index, req.n),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=req.top_logprobs_k(),
            prompt_logprobs=req.prompt_logprobs_k(),
            repetition_penalty=(d.get("repetition_penalty", 1.0) if req.repetition_penalty is None
                                else float(req.repetition_penalty)),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            presence_penalty=float(req.presence_penalty or 0.0),
            logit_bias=logit_bias(req),
            min_tokens=req.min_tokens,
            structured_outputs=structured,
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=tuple(req.bad_words or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
    except DraftsmithError as e:
        msg = str(e)
        param = next((f for f in _SAMPLING_FIELDS if msg.startswith(f)), None)
        if msg.startswith("structured outputs"):  # (the request's grammar is checked before: not reached)
            param = "structured_outputs"
        raise APIError(400, msg, param=param, code="invalid_value") from None

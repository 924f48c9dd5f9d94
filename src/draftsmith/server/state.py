"""What the server holds between requests (`ServerState`): the model, the engine thread, the
metrics, the HTTP side's tokenizer, and admission (`Limits`).

Admission (`serve --max-choices-per-request / --max-prompt-bytes / --max-queued-tokens`):
prompts x n per request; bytes of prompt text per request (the body may be 6x that + 1 MiB:
a JSON \\u escape is 6 bytes); tokens queued server-wide (prompt + max_tokens of every choice
admitted and unfinished: past it a request gets a 429, or a 400 if it alone is larger).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from draftsmith.api import LLM
from draftsmith.drafters.base import NoDrafter
from draftsmith.core.structured import Grammars
from draftsmith.errors import DraftsmithError
from draftsmith.models.token_text import TokenText
from draftsmith.server.engine_loop import EngineLoop
from draftsmith.server.metrics import ServerMetrics
from draftsmith.server.protocol import APIError
from draftsmith.server.reasoning import REASONING_PARSERS
from draftsmith.server.request_metrics import SPEC_DECODE_LEVELS, RequestMetricsOptions
from draftsmith.server.tools import TOOL_CALL_PARSERS


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy names


@dataclass(frozen=True)
class ServeOptions:
    """How the server reads chat requests and orders work (vLLM's serve flags of the same names).

    chat_template: Jinja text in place of the target's template.
    tool_call_parser: turns tool_choice "auto" on, read with this parser (server/tools.py).
    reasoning_parser: chat answers split into reasoning and content (server/reasoning.py), a
        request's grammar applied after the reasoning unless `structured_outputs_in_reasoning`
        (vLLM's enable_in_reasoning).
    scheduling_policy: "priority" lets requests' `priority` order admission, "fcfs" refuses it.
    default_chat_template_kwargs: the chat template's variables for every chat request (e.g.
        Qwen3's {"enable_thinking": false}); a request's own chat_template_kwargs win, key by key.
    per_request_metrics / per_request_spec_decode_metrics ("none", "summary", "detailed"): a
        response's `metrics` object, timing / speculative_decoding (server/request_metrics.py).
    force_include_usage: every stream ends with its usage chunk, as if it asked
        (stream_options.include_usage; vLLM's --enable-force-include-usage).
    request_id_headers: every HTTP response carries an `X-Request-Id` header, the request's own
        or a fresh one (vLLM's --enable-request-id-headers).
    return_tokens_as_token_ids: logprobs name tokens `token_id:N` where a request does not say
        (its own return_tokens_as_token_ids wins; vLLM's --return-tokens-as-token-ids).
    """

    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    structured_outputs_in_reasoning: bool = False
    scheduling_policy: str = "fcfs"
    default_chat_template_kwargs: dict[str, Any] | None = None
    per_request_metrics: bool = False
    per_request_spec_decode_metrics: str = "none"
    force_include_usage: bool = False
    request_id_headers: bool = False
    return_tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        for what, value, known in (("tool-call parser", self.tool_call_parser, TOOL_CALL_PARSERS),
                                   ("reasoning parser", self.reasoning_parser, REASONING_PARSERS),
                                   ("scheduling policy", self.scheduling_policy, SCHEDULING_POLICIES),
                                   ("per-request spec decode metrics level", self.per_request_spec_decode_metrics,
                                    SPEC_DECODE_LEVELS)):
            if value is not None and value not in known:
                raise DraftsmithError(f"unknown {what} {value!r}; known: {', '.join(known)}")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much work may wait (see the module docstring)."""

    max_choices: int = 256  # prompts x n of one request
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of one request's prompt text
    max_queued_tokens: int | None = None  # None: 32 x max_batch x max_len

    def __post_init__(self) -> None:
        for name in ("max_choices", "max_prompt_bytes", "max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise DraftsmithError(f"{name} must be a positive integer, got {v}")

    @property
    def max_body_bytes(self) -> int:
        return 6 * self.max_prompt_bytes + (1 << 20)


class TooManyTokens(APIError):
    """A request that alone may need more tokens than the server queues (`tokens` over `limit`)."""

    def __init__(self, tokens: int, choices: int, limit: int) -> None:
        super().__init__(400, f"this request may need up to {tokens} tokens (prompt + max_tokens over its "
                         f"{choices} choice(s)), over this server's limit of {limit}; lower max_tokens, n or "
                         "the number of prompts", code="too_many_tokens")
        self.tokens, self.limit = tokens, limit


class _Front:
    """The HTTP thread's tokenizer: a private copy (the engine thread decodes with the
    original; fast tokenizers are not safe to share across threads), used through LLM's
    own encode / apply_chat_template so prompts match `LLM.generate` exactly."""

    apply_chat_template = LLM.apply_chat_template
    encode = LLM.encode

    def __init__(self, llm: LLM) -> None:
        self.target = llm.target
        self.tokenizer = copy.deepcopy(llm.tokenizer)
        self.token_text = TokenText(self.tokenizer)  # logprobs' token texts and bytes
        # structured outputs: a request's grammar is checked here, before it reaches the engine
        self.grammars = Grammars(self.tokenizer, llm.target.model.config.vocab_size, llm.engine.eos_token_ids,
                                 share=llm.engine.grammars)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)



class ServerState:
    def __init__(self, llm: LLM, model_name: str | None = None, api_key: str | None = None,
                 limits: Limits | None = None, options: ServeOptions | None = None) -> None:
        self.llm = llm
        self.options = options or ServeOptions()
        self.model_id = model_name or llm.target.target_id
        self.max_len = llm.engine.max_len
        self.vocab_size = llm.target.model.config.vocab_size
        self.api_key = api_key or None
        self.limits = limits or Limits()
        self.max_queued_tokens = self.limits.max_queued_tokens or 32 * llm.engine.config.max_batch * self.max_len
        self.queued_tokens = 0  # prompt + max_tokens of the choices admitted and unfinished (event loop only)
        self.front = _Front(llm)
        k = 0 if isinstance(llm.drafter, NoDrafter) else llm.num_speculative_tokens  # (no drafter: no spec metrics)
        self.metrics = ServerMetrics(self.model_id, llm.engine.config.max_batch, k)
        self.request_metrics = RequestMetricsOptions(self.options.per_request_metrics,
                                                     self.options.per_request_spec_decode_metrics, k)
        self.loop = EngineLoop(llm.engine, self.metrics, self.request_metrics)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

    def check_size(self, n_prompts: int, n: int, prompt_bytes: int, prompt_param: str) -> None:
        lim = self.limits
        if n_prompts * n > lim.max_choices:
            raise APIError(400, f"this request asks for {n_prompts} prompt(s) x n={n} = {n_prompts * n} choices; "
                           f"this server allows at most {lim.max_choices} per request", param="n",
                           code="too_many_choices")
        if prompt_bytes > lim.max_prompt_bytes:
            raise APIError(400, f"the prompt text is {prompt_bytes} bytes; this server allows at most "
                           f"{lim.max_prompt_bytes} bytes per request", param=prompt_param, code="prompt_too_large")

    def reserve(self, tokens: int, choices: int) -> None:
        """Count `tokens` as queued, or refuse: 400 if the request alone is over the limit, else 429."""
        limit = self.max_queued_tokens
        if tokens > limit:
            raise TooManyTokens(tokens, choices, limit)
        if self.queued_tokens + tokens > limit:
            raise APIError(429, f"the server is busy: {self.queued_tokens} tokens are queued and this request may "
                           f"need {tokens} more, over the limit of {limit}; retry later",
                           type="rate_limit_exceeded", code="too_many_queued_tokens")
        self.queued_tokens += tokens

"""OpenAI-compatible request models and error bodies.

The completions and chat requests' fields read as vLLM's (pydantic's lax mode): a numeric
string for a number ("3", "0.5"), an int for a float, 3.0 for an int, 0 / 1 or "true" / "false"
for a bool; what lax mode refuses ("3.5" or 3.5 for an int, "abc") is a 400, and so is
true / false for a number (a client bug, though pydantic would read it as 1 / 0). `null` for an
optional field is the field unset (what the official client sends for a None), except where
vLLM declares the field non-Optional (`ignore_eos`, `min_tokens`, completions' `n`, chat's
`echo`, ...: a 400 there too). Unknown fields are ignored, as OpenAI-compatible servers usually
do. Options Draftsmith cannot honour (suffix, best_of != n; vLLM's use_beam_search,
logits_processors, structural_tag, a structured-outputs backend other than llguidance) are
rejected with a 400 rather than silently ignored. Tool calling's fields (`tools`, `tool_choice`, `parallel_tool_calls`, messages
with `tool_calls` and the `tool` role) are OpenAI's; server/tools.py gives them their meaning.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      model_validator)
from pydantic_core import PydanticCustomError

from draftsmith.core.logprobs import MAX_LOGPROBS


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    errs = e.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error(s))"
    return APIError(400, msg, param=param, code="invalid_value" if loc else None)


LLGUIDANCE = ("auto", "guidance", "llguidance")  # structured-outputs backends that name Draftsmith's


def backend_refusal(backend: Any) -> str:
    """The 400's message for a structured-outputs backend Draftsmith does not have (the top-level
    `guided_decoding_backend` here; `structured_outputs.backend` in server/structured.py, which
    every route's structured_outputs passes)."""
    return (f"the structured-outputs backend {backend!r} is not available: Draftsmith's structured outputs run "
            f"on llguidance ({', '.join(map(repr, LLGUIDANCE))} name it, as vLLM's guidance backend); leave the "
            "backend out")


def _in_range(k: int | None, param: str) -> int | None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens to list "
                       f"beside each token), got {k}", param=param, code="invalid_value")
    return k


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not true or false")
    return v


# vLLM's lax numbers (the module docstring): "3" / 3.0 -> 3, "0.5" / 1 -> a float; true / false refused
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = bool  # lax: 0 / 1, "true" / "false", ... (pydantic's), as vLLM's


class _VllmFields(_Req):
    """A request read as vLLM reads it: lax types (Int, Float, Bool), and `null` for an optional
    field that does not itself take None is the field unset (its default), unless vLLM refuses
    null there too (`_NULL_REFUSED`: its non-Optional fields). A field typed `X | None` keeps the
    None, which means what vLLM's None means (completions' `max_tokens: null`: the rest of the
    context; `stream_options.include_usage: null`: no usage)."""

    _NULL_REFUSED: ClassVar[frozenset[str]] = frozenset()
    _null_unsets: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_unsets = frozenset(
            name for name, f in cls.model_fields.items()
            if not f.is_required() and name not in cls._NULL_REFUSED
            and f.annotation is not Any and type(None) not in get_args(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in cls._null_unsets}
        return data


class StreamOptions(_VllmFields):
    # a last chunk with the request's usage; true once stream_options is given, as vLLM's StreamOptions
    # (`{}` or `{"continuous_usage_stats": true}` alone send usage); null: none
    include_usage: Bool | None = True
    continuous_usage_stats: Bool | None = False  # vLLM's (with include_usage): every chunk with its usage so far


class _Sampling(_VllmFields):
    # vLLM's non-Optional fields of both requests
    _NULL_REFUSED = frozenset({"ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                               "priority", "request_id", "use_beam_search"})
    model: StrictStr | None = None
    temperature: Float | None = None  # OpenAI default 1.0
    top_p: Float | None = None
    n: Int = Field(default=1, ge=1, le=64)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    # vLLM-style extensions
    top_k: Int | None = None
    min_p: Float | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    allowed_token_ids: list[Int] | None = None
    bad_words: list[StrictStr] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    truncate_prompt_tokens: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM's: the prompt's tokens scored (whole responses only)
    return_token_ids: Bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: Bool | None = None  # vLLM's: logprobs name tokens `token_id:N`
    cache_salt: StrictStr | None = Field(default=None, min_length=1)  # vLLM's: prefix cache shared per salt
    priority: Int = 0  # vLLM's: lower is admitted first (serve --scheduling-policy priority)
    request_id: StrictStr = ""  # vLLM's: the response's id is chatcmpl- / cmpl- + it (an X-Request-Id header wins)
    # structured outputs (server/sampling.structured_outputs): OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    # vLLM's, refused (check_vllm_options): never silently ignored
    use_beam_search: Bool = False
    logits_processors: Any = None
    structural_tag: Any = None  # vLLM 0.10's top-level structural tag
    guided_decoding_backend: StrictStr | None = None  # (and structured_outputs.backend)

    def check_vllm_options(self) -> None:
        """A 400 for a vLLM option Draftsmith does not honour (silently ignored, beam search gave n
        greedy copies); a `guided_decoding_backend` that names llguidance, Draftsmith's, is
        accepted (`structured_outputs.backend`: server/structured.structured_outputs)."""
        def refuse(param: str, why: str) -> None:
            raise APIError(400, why, param=param, code="unsupported_parameter")

        if self.use_beam_search:
            refuse("use_beam_search", "use_beam_search is not supported: Draftsmith does not do beam search (n "
                   "samples n independent choices); leave it out")
        if self.logits_processors:
            refuse("logits_processors", "The `logits_processors` argument is not supported by this server (vLLM "
                   "refuses it too without --logits-processor-pattern): Draftsmith runs no code a request names; "
                   "logit_bias, allowed_token_ids and bad_words shape the logits")
        if self.structural_tag is not None:
            refuse("structural_tag", "structural_tag is not supported: Draftsmith's structured outputs are json, "
                   "regex, choice or grammar (structured_outputs, guided_*, response_format)")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in LLGUIDANCE:
            refuse("guided_decoding_backend", backend_refusal(self.guided_decoding_backend))

    def prompt_logprobs_k(self) -> int | None:
        """How many top tokens per prompt token the engine computes (vLLM's `prompt_logprobs`;
        completions' `echo` with `logprobs` too)."""
        return _in_range(self.prompt_logprobs, "prompt_logprobs")

    def shown_prompt_logprobs(self) -> int | None:
        """The k of the `prompt_logprobs` a whole response carries (None: none): the field, or
        with `echo` what vLLM's to_sampling_params puts in its place."""
        return _Sampling.prompt_logprobs_k(self)

    def unsupported(self) -> list[str]:
        return []


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    _NULL_REFUSED = _Sampling._NULL_REFUSED | {"n", "add_special_tokens"}
    prompt: Prompt
    max_tokens: Int | None = 16  # OpenAI's default for completions; null: the rest of the context (vLLM's)
    logprobs: Int | None = None
    echo: Bool = False
    add_special_tokens: Bool = True  # vLLM's: False for a prompt already rendered with them
    best_of: Int | None = None
    suffix: StrictStr | None = None

    def top_logprobs_k(self) -> int | None:
        """How many top tokens per generated token (None: no logprobs)."""
        return _in_range(self.logprobs, "logprobs")

    def prompt_logprobs_k(self) -> int | None:
        ks = [k for k in (super().prompt_logprobs_k(), self.top_logprobs_k() if self.echo else None) if k is not None]
        return max(ks) if ks else None

    def shown_prompt_logprobs(self) -> int | None:
        k = super().shown_prompt_logprobs()  # vLLM's: with echo, prompt_logprobs defaults to logprobs
        return self.top_logprobs_k() if k is None and self.echo else k

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of not in (None, self.n):
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class TextPart(_Req):
    type: Literal["text"]
    text: StrictStr


class FunctionDefinition(_Req):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Req):
    name: StrictStr


class NamedToolChoice(_Req):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Req):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(_Req):
    """A call an assistant message made earlier in the conversation."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: StrictStr | None = None  # a tool's: the call it answers
    reasoning: StrictStr | None = None  # an assistant's earlier reasoning (vLLM's name)
    reasoning_content: StrictStr | None = None  # (its older name)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    _NULL_REFUSED = _Sampling._NULL_REFUSED | {"include_reasoning", "echo", "add_generation_prompt",
                                               "continue_final_message"}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None  # default: the rest of the context
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    include_reasoning: Bool = True  # with a reasoning parser: False leaves the reasoning out
    echo: Bool = False  # vLLM's: the answer's content starts with the last message's when it is the assistant's
    # vLLM's chat-template options
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None  # vLLM's per-request template: refused (the route says why), never ignored

    def top_logprobs_k(self) -> int | None:
        """How many top tokens per generated token (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return _in_range(self.top_logprobs or 0, "top_logprobs") if self.logprobs else None

    def shown_prompt_logprobs(self) -> int | None:
        # vLLM's: with echo, prompt_logprobs defaults to top_logprobs (0 when unset); a stream shows none
        if self.prompt_logprobs is None and self.echo and not self.stream:
            return _in_range(self.top_logprobs or 0, "top_logprobs")
        return super().shown_prompt_logprobs()

    def prompt_logprobs_k(self) -> int | None:
        return self.shown_prompt_logprobs()


class TokenizeRequest(_Req):
    """vLLM's POST /tokenize: `prompt` (tokenized as /v1/completions does) or `messages` (as
    /v1/chat/completions does: the chat template with the assistant's turn opened)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # for a tool-aware chat template, as in chat requests
    return_token_strs: StrictBool = False
    add_special_tokens: StrictBool = True  # a prompt's (the chat template places a chat's own)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None  # (refused, as in chat requests)


class DetokenizeRequest(_Req):
    model: StrictStr | None = None
    tokens: list[StrictInt]

"""The Messages API's errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`
with the HTTP status of the chat route's error, the type Anthropic's name for that status (400 and
other 4xx invalid_request_error, 401 authentication_error, 403 permission_error, 404
not_found_error, 413 request_too_large, 429 rate_limit_error, 5xx api_error: this server's 503
"the engine is not running" too, as Anthropic keeps overloaded_error for its 529). Every error on
a /v1/messages path is written so (server/app.py's handlers: a 405, an unexpected exception's
500 too). Anthropic's error has no `param`: the message starts with the field it is about where
it does not name it already, and errors of the chat machinery name the Messages field (`stop` ->
stop_sequences, `response_format` -> output_config.format, ...). In a stream, an error is
`event: error` with the same body (the `anthropic` package raises it as an APIStatusError).
"""

from __future__ import annotations

from draftsmith.server.protocol import APIError
from draftsmith.server.state import TooManyTokens

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
          429: "rate_limit_error"}
# what the chat machinery calls a field, and its name in a Messages request
_PARAMS = {"prompt": "messages", "stop": "stop_sequences", "response_format": "output_config.format",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(APIError):
    """An error answered in Anthropic's shape (the app's handler writes `body()`); its message
    names `param` (it starts with it where it does not name it already)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        if param and param not in message:
            message = f"{param}: {message}"
        super().__init__(status, message, type=error_type(status), param=param, code=code)

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def messages_error(e: APIError) -> AnthropicError:
    """An error of the chat machinery (or of reading the request) as a Messages request names it."""
    if isinstance(e, AnthropicError):
        return e
    if isinstance(e, TooManyTokens):  # (worded for chat's prompts and n, which a Messages request has not)
        return AnthropicError(e.status, f"this request may need up to {e.tokens} tokens (its messages + max_tokens), "
                              f"over this server's limit of {e.limit}; lower max_tokens or send fewer messages",
                              param="max_tokens", code=e.code)
    message = e.message.replace("response_format", "output_config.format")
    return AnthropicError(e.status, message, param=_PARAMS.get(e.param, e.param), code=e.code)


def stream_error(err: dict) -> dict:
    """The `error` event's body for a chat stream's error object (an engine error midway, a 500;
    the request's own grammar failing, a 400: invalid_request_error)."""
    kind = "invalid_request_error" if err.get("type") == "invalid_request_error" else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err["message"]}}

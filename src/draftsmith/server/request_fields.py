"""What the Responses and Messages requests (server/responses_request.py, messages_request.py)
share on their way to the chat request /v1/chat/completions serves: vLLM's extra fields, reading
one piece of a request into its model (a 400 that names where it is), and the chat request their
fields make."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictFloat, StrictInt, StrictStr, ValidationError

from draftsmith.server.protocol import APIError, ChatCompletionRequest, _Req


class VllmExtras(_Req):
    """vLLM's extras, passed to the chat request as they are (their checks are chat's)."""

    seed: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    priority: StrictInt | None = None  # (None: 0)
    cache_salt: StrictStr | None = Field(default=None, min_length=1)
    structured_outputs: dict[str, Any] | None = None  # regex, choice, grammar, ...

    def extras(self) -> dict[str, Any]:
        """The chat request's fields of the same names."""
        return {name: getattr(self, name) for name in VllmExtras.model_fields}


def parse(model: type[BaseModel], item: Any, where: str, param: str, error: type[APIError] = APIError) -> Any:
    """`item` read into `model`; else a 400 (`error`) whose message starts with `where` and the
    failing field inside it (`input[2].content`, `tools[0].input_schema`)."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise error(400, f"{where}{'.' + loc if loc else ''}: {err.get('msg')}", param=param,
                    code="invalid_value") from None


def chat_of(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of `body`'s fields (None: left out)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # (every field was checked before: a server bug)
        raise APIError(500, f"could not build the chat request: {e.errors()[:1]}", type="internal_error") from None

"""A request body, read and validated: JSON media type, size limit, valid JSON and Unicode,
one of the protocol's request models, no unsupported parameter."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from draftsmith.server.protocol import APIError, validation_error


async def read_body(request: Request, limit: int) -> bytes:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        got = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
        raise APIError(415, f"send the request body as JSON with `Content-Type: application/json` (got {got})",
                       code="unsupported_media_type")
    body = bytearray()
    async for chunk in request.stream():  # ClientDisconnect if the client leaves mid-body
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                           code="request_too_large")
    return bytes(body)


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    raw = await read_body(request, max_bytes)
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # lone surrogates ("\ud800") cannot be encoded
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body has a lone UTF-16 surrogate (such as \\ud800) in a string; "
                       "strings must be valid Unicode", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def reject_unsupported(req: Any) -> None:
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]} is not supported by this server", param=bad[0], code="unsupported_parameter")
    req.check_vllm_options()


def text_bytes(texts: list) -> int:
    return sum(len(t.encode()) for t in texts if isinstance(t, str))

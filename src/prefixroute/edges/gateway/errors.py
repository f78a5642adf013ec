"""Errors a caller can see, in the shape OpenAI clients parse.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP
status (the OpenAI API's envelope; the official client raises ``AuthenticationError`` for 401,
``RateLimitError`` for 429, ``BadRequestError`` for 400 and so on from the status alone).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

# HTTP status -> OpenAI error type (the ``type`` values the OpenAI API itself uses).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """A request the gateway answers itself with an error (never a traceback)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500
                               else "internal_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=headers)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error(message: str, type_: str = "upstream_error", code: str | None = None) -> bytes:
    """An error as one server-sent event, the way vLLM ends a stream that failed midway
    (``data: {"error": ...}``), followed by the terminator clients wait for."""
    payload = json.dumps(error_body(message, type_, None, code))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()

"""Errors a client sees, in OpenAI's shape or, on `/v1/messages`, Anthropic's.

OpenAI: `{"error": {"message", "type", "param", "code"}}`
(https://platform.openai.com/docs/guides/error-codes). Anthropic:
`{"type": "error", "error": {"type", "message"}}`
(https://docs.anthropic.com/en/api/errors). A 500 says only that the server
failed and where to look; its traceback goes to the server's log, never to the
client.
"""

from __future__ import annotations

import json

# HTTP status -> (OpenAI error type, Anthropic error type)
TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """A request the server refuses (or fails), with the HTTP status to answer it with."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def openai(self) -> dict:
        kind = TYPES.get(self.status, TYPES[500])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def anthropic(self) -> dict:
        kind = TYPES.get(self.status, TYPES[500])[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, anthropic: bool) -> bytes:
        return json.dumps(self.anthropic() if anthropic else self.openai()).encode()


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


INTERNAL = "the server failed while serving this request; its log has the details"
SHUT_DOWN = "the server shut down before this answer was finished; send the request again once it is back"


def shut_down(event) -> ApiError | None:
    """A job's last event, when the server's shutdown cancelled it: the error to answer with
    (503), not a finished answer (a client that left never reads it)."""
    return ApiError(503, SHUT_DOWN) if getattr(event, "reason", None) == "cancelled" else None

"""The Anthropic Messages front's errors: every failure as Anthropic's
``{"type": "error", "error": {"type", "message"}}``.

The HTTP status comes from the one table (``gateway.status``), through the checks this front
shares with the OpenAI front, which raise ``OpenAIError`` (status, message, field): ``anthropic``
re-spells one. Statuses and types, with the ``anthropic`` client's exception class:

* 400 ``invalid_request_error`` (``BadRequestError``): a bad value, an unknown or unserved field,
  malformed JSON or a wrong type (never FastAPI's 422);
* 401 ``authentication_error`` (``AuthenticationError``);
* 404 ``not_found_error`` (``NotFoundError``): a model this server does not serve;
* 529 ``overloaded_error`` (``OverloadedError``): admission refused the request (``Overloaded``,
  RESOURCE_EXHAUSTED, the OpenAI front's 429). Anthropic keeps 429 for a client's rate limit;
  Baton's 429 is the cluster being full, which is Anthropic's 529, so Baton never sends 429 here;
* 503 ``api_error`` (``ServiceUnavailableError``): no worker ready, a worker failed, the store;
* 500 ``api_error`` (``InternalServerError``): anything else.

529 and 503 carry ``Retry-After``. The message starts with the offending field when the check
named one (Anthropic's errors have no ``param``).
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from gateway.openai_errors import OpenAIError

OVERLOADED = 529
"""Anthropic's status for a server too busy to take the request."""
ERROR_TYPES: dict[int, str] = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}
"""Anthropic's error type by status; another 4xx is ``invalid_request_error``, a 5xx
``api_error``."""


class AnthropicError(Exception):
    """An error answered in Anthropic's format."""

    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        default = "api_error" if self.status >= 500 else "invalid_request_error"
        self.body = {"type": "error",
                     "error": {"type": ERROR_TYPES.get(self.status, default), "message": message}}
        self.headers = {"Retry-After": retry_after} if retry_after is not None else {}

    def response(self, headers: dict[str, str]) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=headers | self.headers)


def anthropic(error: OpenAIError | AnthropicError) -> AnthropicError:
    """``error`` in Anthropic's spelling (see the module docstring)."""
    if isinstance(error, AnthropicError):
        return error
    detail = error.body["error"]
    message, param = detail["message"], detail["param"]
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    status = OVERLOADED if error.status == HTTPStatus.TOO_MANY_REQUESTS else error.status
    return AnthropicError(status, message, error.headers.get("Retry-After"))

"""The OpenAI HTTP front's errors: Baton errors and bad bodies as OpenAI error answers.

Every failure is answered as ``{"error": {message, type, param, code}}``. The HTTP status is
the error kind's in ``gateway.status`` (``InvalidRequest`` 400, ``UnknownModel`` 404,
``Overloaded`` 429, ``NoWorkerReady``/``WorkerFailed`` 503, anything else 500) and ``code`` is
that kind's name; 429 and 503 carry ``Retry-After``.
Malformed JSON and wrong field types are 400 (``validation_message``), not FastAPI's 422.
``translated`` is the one place router exceptions become ``OpenAIError``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway.status import STATUS_BY_ERROR, category_of, retry_after_s
from protos.errors import BatonError, InvalidRequest

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered in OpenAI's format; raised by handlers, rendered by ``build_app``."""

    def __init__(
        self,
        status: HTTPStatus | int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def error_for(error: BatonError, param: str | None = None) -> OpenAIError:
    """The HTTP answer for a Baton error, chosen by its kind (see module docstring)."""
    kind = category_of(error)
    status = STATUS_BY_ERROR[kind].http_status
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower()
    retry_s = retry_after_s(error)
    retry_after = None if retry_s is None else max(1, math.ceil(retry_s))  # whole seconds
    if status in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND):
        return OpenAIError(status, str(error), "invalid_request_error", param, code)
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return OpenAIError(status, str(error), "rate_limit_error", param, code, retry_after)
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return OpenAIError(status, str(error), "server_error", param, code, retry_after)
    return OpenAIError(status, str(error), "server_error", param, code)


def _internal_error(request_id: str) -> OpenAIError:
    return OpenAIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"internal error while serving request {request_id}; the gateway log has the details",
        "server_error",
    )


@contextlib.contextmanager
def translated(request_id: str):
    """Turns whatever the router raises into an ``OpenAIError``, logging the unexpected."""
    try:
        yield
    except OpenAIError:
        raise
    except BatonError as e:
        raise error_for(e) from e
    except Exception as e:
        logger.exception("request %s failed inside the HTTP front", request_id)
        raise _internal_error(request_id) from e


def validation_message(error: RequestValidationError | ValidationError,
                       reference: str = "the OpenAI API reference") -> tuple[str, str | None]:
    """One readable message (and the first offending field) from FastAPI's (or pydantic's)
    error list; the message ends by pointing at ``reference`` for the fields."""
    parts, params = [], []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"] if part != "body")
        if item["type"] == "json_invalid":
            detail = item.get("ctx", {}).get("error", "")
            parts.append(f"the request body is not valid JSON ({detail})")
            continue
        params.append(where or None)
        parts.append(f"{where or 'request body'}: {item['msg']}")
    message = "; ".join(parts) + f"; see {reference} for the fields"
    return message, params[0] if params else None


def _surrogate_at(value: Any, where: str) -> str | None:
    """The path of the first string (or key) in ``value`` that no UTF-8 encoder takes."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return where or "request body"
        return None
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        path = f"{where}.{key}" if where else str(key)
        found = _surrogate_at(key, path) or _surrogate_at(item, path)
        if found is not None:
            return found
    return None


def lone_surrogate(body: Any) -> OpenAIError | None:
    """The 400 for a parsed body holding a lone UTF-16 surrogate escape (``"\\ud800"``), or None.

    Python's json module (FastAPI's parser) accepts one, but it is no Unicode text: the
    tokenizer, the wire to the workers and the error answer itself would fail on it (a 500).
    The Anthropic routes' parser refuses such JSON outright; this answers the same."""
    where = _surrogate_at(body, "")
    if where is None:
        return None
    where = where.encode(errors="backslashreplace").decode()
    message = (f"the request body is not valid JSON (the string at {where} holds a lone UTF-16 "
               "surrogate escape, which is no Unicode text); see the OpenAI API reference for "
               "the fields")
    return error_for(InvalidRequest(message), where)

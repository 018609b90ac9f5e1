"""Every error leaves the server as OpenAI's JSON shape:
{"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with a 4xx/5xx status."""
from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import BusyError, ConfigError, ContextFullError, EdgespecError, EngineClosedError

__all__ = ["APIError", "error_body", "install_error_handlers", "validation_message"]

logger = logging.getLogger(__name__)

_HTTP_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error"}


class APIError(Exception):
    """An error to send to the client as it is."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _from_edgespec(e: EdgespecError) -> APIError:
    if isinstance(e, ConfigError):
        return APIError(400, str(e))
    if isinstance(e, ContextFullError):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (BusyError, EngineClosedError)):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    return APIError(500, str(e), type="server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: Any) -> bool:
    # pydantic names the member of a union it tried in the location: "str", "list[str]", ...
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[]-("))


def _loc(err: dict[str, Any]) -> tuple:
    return tuple(p for p in err.get("loc", ()) if p != "body" and not _is_union_tag(p))


def _branch(err: dict[str, Any]) -> str | None:
    """The member of a union an error comes from ("list[int]"), None outside a union."""
    return next((p for p in err.get("loc", ()) if _is_union_tag(p)), None)


def _closest(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one field's errors, the one that says most: a range or length problem before "should be
    a string"; of a union's members, the one the value came closest to (fewest errors, deepest,
    furthest into a list), so [true, 5] is told its item 0 is no integer rather than that it is
    no string."""
    per_branch = Counter(_branch(e) for e in errors)

    def rank(e: dict[str, Any]) -> tuple:
        loc = e.get("loc", ()) or ("",)
        reached = loc[-1] if isinstance(loc[-1], int) else 0  # a list's member failing later got further
        return str(e.get("type", "")).endswith("_type"), per_branch[_branch(e)], -len(loc), -reached

    return min(errors, key=rank)


def _shown(value: Any) -> str:
    """A value as JSON writes it (NaN, Infinity and -Infinity by their names), cut short."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line and the offending parameter for pydantic's errors (the first field's)."""
    if not errors:
        return "Invalid request.", None
    first = _loc(errors[0])
    err = _closest([e for e in errors if _loc(e)[:1] == first[:1]])
    param = ".".join(str(p) for p in _loc(err)) or None
    if err.get("type") == "json_invalid":
        return "We could not parse the JSON body of your request (it must be a valid JSON object).", None
    if err.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    msg = err.get("msg", "invalid value")
    if "input" in err and param:  # the value named, so a NaN is called NaN, not "should be less than 1"
        msg = f"{msg}, got {_shown(err['input'])}"
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request body: {msg}."), param


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's {"detail": ...} errors (and its 422) with OpenAI's shape and 400."""

    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = _HTTP_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(error_body(str(e.detail), kind, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(EdgespecError)
    async def _edgespec(_: Request, e: EdgespecError) -> JSONResponse:
        err = _from_edgespec(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(error_body("The server had an error while processing your request.", "server_error"),
                            status_code=500)

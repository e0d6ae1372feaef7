"""The one place where errors become HTTP responses (OpenAI error JSON)."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse, Response

from pdserve.errors import EngineAnswer, Overloaded, RequestError

log = logging.getLogger(__name__)


def error_body(message: str, err_type: str, status: int, param: str | None = None,
               code: str | int | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code if code else status}}


def to_response(exc: BaseException, request_id: str | None = None) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if isinstance(exc, EngineAnswer):  # the engine's own error answer, passed on unchanged
        return Response(exc.body, status_code=exc.status, media_type=exc.content_type, headers=headers)
    if isinstance(exc, RequestError):
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(exc.retry_after_s)
            if exc.retry_after_ms is not None:
                headers["retry-after-ms"] = str(exc.retry_after_ms)
        body = error_body(exc.message, exc.error_type, exc.status_code, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status_code, headers=headers)
    log.exception("request %s: unexpected error", request_id, exc_info=exc)
    return JSONResponse(
        error_body("internal error in the router", "internal_error", 500), status_code=500, headers=headers
    )


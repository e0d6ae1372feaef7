"""Every error pdserve raises on purpose.

    PDServeError
    ├── ConfigError                  the YAML or the arguments are wrong (names the file and the field)
    ├── ModelError                   the model cannot be located or prepared
    ├── EngineStartError             a vLLM engine did not come up
    └── RequestError                 a request could not be served; carries an HTTP status
        ├── BadRequest               400: the request itself is wrong
        ├── Unauthorized             401
        ├── NotFound                 404: an unknown stored response
        │   └── ModelNotFound        404: unknown model name
        ├── PayloadTooLarge          413
        ├── Overloaded               429
        ├── UpstreamError            502: an engine answered with something we cannot use
        ├── NoEngineAvailable        503: no healthy replica for a role
        └── UpstreamTimeout          504: a leg did not answer in time
    EngineAnswer                     an engine answered with an error status: passed to the client unchanged

Only ``pdserve.router.http_errors`` turns these into HTTP responses.
"""

from __future__ import annotations


class PDServeError(Exception):
    """Base class of all pdserve errors."""


class ConfigError(PDServeError):
    """Invalid configuration. ``str(err)`` is meant to be shown to the user as is."""


class ModelError(PDServeError):
    """The model could not be found or prepared."""


class EngineStartError(PDServeError):
    """An engine process failed to start or to become healthy."""


class RequestError(PDServeError):
    """A request that cannot be served. Subclasses fix the HTTP status and OpenAI error type."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequest(RequestError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(RequestError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(RequestError):
    status_code = 403
    error_type = "permission_error"


class NotFound(RequestError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    pass


class PayloadTooLarge(RequestError):
    status_code = 413
    error_type = "invalid_request_error"


class Overloaded(RequestError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, retry_after_ms: int | None = None) -> None:
        """``retry_after_ms``: the finer wait (the ``retry-after-ms`` header, which OpenAI's clients read
        before ``Retry-After``); ``Retry-After`` is then its whole seconds, rounded up."""
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.retry_after_s = max(1, -(-retry_after_ms // 1000)) if retry_after_ms is not None else retry_after_s


class UpstreamError(RequestError):
    status_code = 502
    error_type = "upstream_error"


class EngineRefusedKey(UpstreamError):
    """An engine answered the router's own key with 401/403: the address the app's registry gives for it is
    served by another process, or by an engine that replaced it. Never the client's fault: the client gets
    a 502 (or another engine), and the engine is out of rotation until the registry names it anew."""


class NoEngineAvailable(RequestError):
    status_code = 503
    error_type = "service_unavailable"


class ShuttingDown(NoEngineAvailable):
    """The router is stopping: a request that arrives now (or whose connection pool closed under it) is
    answered 503, so the client retries elsewhere."""

    def __init__(self) -> None:
        super().__init__("this router replica is shutting down; retry the request")


class UpstreamTimeout(RequestError):
    status_code = 504
    error_type = "timeout"


class EngineAnswer(PDServeError):
    """An engine answered with an error status; its body is passed to the client unchanged (status, body and
    content type)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type

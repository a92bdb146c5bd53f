"""`APIError`: the one exception a handler raises for a request it refuses.

It carries the HTTP status and the OpenAI error object (`message`, `type`, `param`, `code`), so
HTTP answers it as a JSON body and the WebSocket as an `error` event, with the same content.
A refusal for load (`overloaded`: 429, code "overloaded") also carries `retry_after_s`: HTTP
sends it as a `Retry-After` header (whole seconds), the error object and the WebSocket event
as `retry_after`.
`from_decode_error` turns a msgspec decoding error into a 400 whose `param` names the field.
"""

from __future__ import annotations

import math
import re

import msgspec

_PATH = re.compile(r"at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(math.ceil(self.retry_after_s))}  # HTTP allows whole seconds only

    def error_object(self) -> dict:
        obj = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.retry_after_s is not None:
            obj["retry_after"] = self.retry_after_s
        return obj

    def body(self) -> dict:
        return {"error": self.error_object()}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: float) -> APIError:
    """The engine's queue is full or the request waited too long to start (OverloadedError)."""
    return APIError(429, message, code="overloaded", retry_after_s=retry_after_s)


def from_decode_error(err: msgspec.MsgspecError, prefix: str = "") -> APIError:
    """msgspec's message already names the field (`... - at `$.messages[0].role``); the field
    path also goes to `param` so clients can point at it."""
    text = str(err)
    if isinstance(err, msgspec.DecodeError) and not isinstance(err, msgspec.ValidationError):
        return bad_request(f"invalid JSON: {text}", code="invalid_json")
    path = _PATH.search(text)
    missing = _MISSING.search(text)
    parts = [path.group(1) if path else "", missing.group(1) if missing else ""]
    param = ".".join(p for p in parts if p) or None
    if param and prefix:
        param = f"{prefix}.{param}"
    return bad_request(text, param=param, code="invalid_type" if "Expected" in text else "invalid_value")

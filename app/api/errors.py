"""The API's errors: ApiError (answered as OpenAI's error JSON) and the middleware that answers
every failure of a handler with one, logging the unexpected ones without the request's content."""

from __future__ import annotations

import logging
import math
import traceback

from aiohttp import web

from app.api.state import MAX_BODY
from engine import InvalidRequest, QueueFull
from engine.request import StepFailed

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status, headers=self.headers)


def log_failure(request: web.Request, exc: BaseException | None) -> None:
    # messages may quote the request (text, token ids), so only the types and where they were raised
    chain = []
    while exc is not None and len(chain) < 4:
        chain.append(f"{type(exc).__name__}, raised at:\n" + "".join(traceback.format_tb(exc.__traceback__)))
        exc = exc.__cause__ or exc.__context__
    log.error("%s %s failed (exception messages withheld: they may quote the request): %s",
              request.method, request.path, "caused by ".join(chain))


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except InvalidRequest as exc:
        return ApiError(400, str(exc)).response()
    except StepFailed as exc:   # logged by the engine, with its traceback
        return ApiError(500, f"{exc} (this request was failed; the server goes on)", type="server_error",
                        code="engine_step_failed").response()
    except QueueFull as exc:
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(retry), "Retry-After-Ms": str(int(exc.retry_after_s * 1000))}
                        ).response()
    except web.HTTPRequestEntityTooLarge:
        return ApiError(413, f"the request body is over the limit of {request.app[MAX_BODY]} bytes",
                        code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}",
                        code=exc.reason.lower().replace(" ", "_")).response()
    except Exception as exc:  # noqa: BLE001 - answered 500 and logged
        log_failure(request, exc)
        return ApiError(500, "internal server error (logged on the server)", type="server_error").response()

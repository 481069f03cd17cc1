"""OpenAI-style error bodies and the mapping from failures to HTTP status codes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_S} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# Request fields an engine ValueError may name (SamplingParams and prompt checks start with the field).
PARAM_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "stop", "logprobs",
                "prompt_logprobs", "prompt",
                "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "logit_bias", "allowed_token_ids", "tools", "best_of", "n",
                "continue_final_message", "chat_template_kwargs")


def param_of(message: str, fields: tuple[str, ...] = PARAM_FIELDS) -> str | None:
    """The request field a ValueError message names (SamplingParams messages start with the field, followed by
    something that cannot continue a name: "n must ..." names n, "no ..." names nothing)."""
    return next((f for f in fields if message.startswith(f) and not message[len(f):len(f) + 1].isidentifier()),
                None)


def from_engine_failure(exc: BaseException) -> APIError:
    """Map an exception raised while talking to an engine replica to an API error (no stack trace)."""
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return APIError(503, "the server is overloaded: too many queued requests; retry later",
                        type_="server_overloaded", code="overloaded")
    if isinstance(raised := replica_error(exc), ValueError):
        message = str(raised)
        return bad_request(message, param=param_of(message, PARAM_FIELDS))
    if replica_lost(exc):
        logger.warning("engine replica lost during a request: %s", type(exc).__name__)
        return APIError(500, "the engine replica serving this request died; retry the request",
                        type_="server_error", code="replica_died")
    logger.error("engine failure: %r", exc)
    return APIError(500, "internal engine error", type_="server_error", code="internal_error")


def replica_error(exc: BaseException) -> BaseException:
    """What the engine replica raised: over Ray actor calls (engine_transport "ray") it comes wrapped in a
    RayTaskError; over Serve's gRPC transport it is the replica's exception itself."""
    from ray.exceptions import RayTaskError

    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


def replica_lost(exc: BaseException) -> bool:
    """The replica went away (its actor died or became unreachable, or its engine shut down under it): not
    something the request did, so it may be sent to another replica if nothing was streamed yet."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from engine.async_engine import EngineDeadError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError)) or isinstance(
        replica_error(exc), EngineDeadError)


def install_handlers(app: FastAPI, on_error: Callable[[Request, int], None] | None = None) -> None:
    """Every error leaves as an OpenAI error body: validation 400, unknown routes 404, the rest 500.
    `on_error(request, status)` sees each one (the ingress counts them)."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [p for p in err.get("loc", ()) if p != "body"]
        # A JSON syntax error's loc is a character offset, not a field.
        param = None if err.get("type") == "json_invalid" else ".".join(map(str, loc)) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return respond(request, bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, APIError(exc.status_code, str(exc.detail), type_=type_))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the ingress")
        return respond(request, APIError(500, "internal server error", type_="server_error"))

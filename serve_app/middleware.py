"""What every HTTP request passes before it is parsed: the body size limit (413) and API keys (401).

Both are plain ASGI middleware on the ingress's FastAPI app, so they run before Starlette reads or parses
a body. The configuration they read (`app.state.tandem_guard`, the app being `scope["app"]`) is set by the
ingress replica at start-up.

API keys, the vLLM way: with keys configured (app config `api_key`, one or a list, or `TANDEM_API_KEY`,
comma-separated), every `/v1/*` route needs `Authorization: Bearer <key>`; `/health` stays open.
Comparison is constant-time.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from ray.exceptions import TaskCancelledError

from serve_app.errors import APIError

KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize")
# Outside /v1 but behind the API key too (vLLM leaves them open): they run the tokenizer on request bodies.
KEYED_ROUTES = ("/tokenize", "/detokenize")


@dataclass(frozen=True)
class Guard:
    api_keys: tuple[str, ...]
    max_body_bytes: int
    on_reject: object = None  # callable(route, status): the ingress counts rejections in its metrics

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if not self.api_keys:
            return True
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        token_bytes = token.strip().encode()
        return any(hmac.compare_digest(token_bytes, key.encode()) for key in self.api_keys)


class GuardMiddleware:
    """413 for a body past the limit (by Content-Length, or while a chunked one streams in: such a body is
    read here, at most the limit, then handed on whole), 401 without a valid key."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        receive = _disconnect_on_cancel(receive)
        owner = scope.get("app")  # the FastAPI app (Starlette sets it before running its middleware)
        guard: Guard | None = getattr(getattr(owner, "state", None), "tandem_guard", None)
        if scope["type"] != "http" or guard is None:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or ())
        route = path if path in KNOWN_ROUTES else "other"
        if (path.startswith("/v1") or path in KEYED_ROUTES) and not guard.authorized(headers):
            return await self._reject(send, guard, route, APIError(
                401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                code="invalid_api_key"), {"www-authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > guard.max_body_bytes:
                return await self._reject(send, guard, route, _too_large(guard))
            return await self.app(scope, receive, send)
        # No length (a chunked upload): read the body here, up to the limit, and hand it on whole.
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to serve
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > guard.max_body_bytes:
                return await self._reject(send, guard, route, _too_large(guard))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _reject(send, guard: Guard, route: str, error: APIError, extra: dict | None = None) -> None:
        if guard.on_reject is not None:
            guard.on_reject(route, error.status)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _disconnect_on_cancel(receive):
    """Serve's ASGI `receive` fetches messages from the proxy with a Ray call; when the client leaves, the
    proxy cancels that call and `receive` raises TaskCancelledError (it maps only a KeyError to a disconnect).
    Starlette's StreamingResponse listens with `receive` for the disconnect, so the exception escaped as an
    unhandled error with a traceback (found by bench/soak.py). Here it is what it means: http.disconnect."""

    async def receive_or_disconnect():
        try:
            return await receive()
        except TaskCancelledError:
            return {"type": "http.disconnect"}

    return receive_or_disconnect


def _too_large(guard: Guard) -> APIError:
    return APIError(413, f"the request body is larger than the {guard.max_body_bytes} bytes allowed "
                         f"(limits.max_body_bytes)", param=None, code="request_too_large")

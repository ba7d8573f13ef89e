"""The HTTP side: routes, the API key, body limits, errors, and responses that follow a job.

`create_app(engine)` is a Starlette app; `Server` runs it with uvicorn, prints
where it listens once the socket is bound, and on shutdown cancels every job
so open streams end at once. All model work happens on the engine's thread;
handlers only parse, queue, and turn the engine's events into JSON or
server-sent events. `JobResponse` watches the connection while it waits: a
client that goes away, streaming or not, cancels its job (out of the queue at
once, or after the token being decoded).
"""

from __future__ import annotations

import hmac
import json
import logging

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import anthropic, openai
from .engine import Closing, Job, QueueFull
from .errors import INTERNAL, ApiError, invalid
from .params import Body

log = logging.getLogger("mlx_spec.server")
MAX_BODY_BYTES = 32 << 20  # a long agent conversation is a few MB of JSON


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(error: ApiError, path: str) -> Response:
    return Response(error.body(_is_anthropic(path)), error.status, media_type="application/json")


class JobResponse(Response):
    """A job's answer: server-sent events as they come, or one JSON body at the end."""

    def __init__(self, job: Job, engine, reply, stream: bool, path: str):
        self.job, self.engine, self.reply, self.stream, self.path = job, engine, reply, stream, path
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:
            async def watch():
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.engine.cancel(self.job)  # the client went away: free its place now
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await (self._events(send) if self.stream else self._body(send))
            except OSError:  # the connection broke while writing
                pass
            finally:
                self.engine.cancel(self.job)  # no-op once the job has finished
                group.cancel_scope.cancel()

    async def _events(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        async for chunk in self.reply.events(self.job):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _body(self, send) -> None:
        try:
            status, body = 200, json.dumps(await self.reply.body(self.job), ensure_ascii=False).encode()
        except ApiError as e:
            status, body = e.status, e.body(_is_anthropic(self.path))
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class ApiKey:
    """ASGI middleware: every route but /health needs the key (Bearer or x-api-key)."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        given = [headers.get(b"x-api-key", b""), auth[7:].strip() if auth[:7].lower() == b"bearer " else b""]
        if not any(hmac.compare_digest(g, self.key) for g in given):  # either header may hold it
            what = "a wrong API key" if any(given) else "no API key"
            error = ApiError(401, f"{what}: send the server's --api-key as 'Authorization: Bearer "
                                  "KEY' (OpenAI clients) or 'x-api-key: KEY' (Anthropic clients)")
            return await error_response(error, scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(engine, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The server's ASGI app around a started `Engine`."""

    async def read_body(request: Request) -> Body:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise _too_large(int(length), max_body_bytes)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_body_bytes:
                raise _too_large(len(data), max_body_bytes)
        try:
            return Body(json.loads(data))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON ({e})") from None
        except RecursionError:
            raise invalid("the request body nests JSON too deeply") from None

    reading = anyio.CapacityLimiter(1)  # one request's prompt is built at a time, off the event loop

    async def parsed(request: Request, parse):
        """`parse(body, engine)` in a worker thread: a long prompt's template and tokenizing
        would otherwise hold up every other client's stream and request while it runs."""
        body = await read_body(request)
        return await anyio.to_thread.run_sync(parse, body, engine, limiter=reading)

    def generation(parse, reply_type):
        async def handler(request: Request):
            try:
                call = await parsed(request, parse)
            except ApiError as e:
                engine.metrics.request_done("rejected" if e.status == 429 else "invalid")
                raise
            job = Job(call.prompt, call.options, call.use_drafter, call.stops, call.logprobs)
            try:
                engine.submit(job)
            except (QueueFull, Closing) as e:
                engine.metrics.request_done("rejected")
                raise ApiError(503 if isinstance(e, Closing) else 429, str(e)) from None
            return JobResponse(job, engine, reply_type(call, engine), call.stream, request.url.path)
        return handler

    async def count_tokens(request: Request):
        return JSONResponse(await parsed(request, anthropic.count_tokens))

    def model_card() -> dict:
        return {"id": engine.model_id, "object": "model", "created": engine.created,
                "owned_by": "mlx-spec", "type": "model", "display_name": engine.model_id,
                "created_at": _iso(engine.created), "drafter": engine.drafter_kind or "none"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()], "has_more": False,
                             "first_id": engine.model_id, "last_id": engine.model_id})

    async def model(request: Request):
        if request.path_params["model_id"] != engine.model_id:
            raise ApiError(404, f"model {request.path_params['model_id']!r} is not served here; "
                                f"this server serves {engine.model_id!r}", "model", "model_not_found")
        return JSONResponse(model_card())

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": engine.model_id,
                             "drafter": engine.drafter_kind or "none"})

    async def metrics(request: Request):
        text = engine.metrics.render(engine.running, engine.waiting, engine.model_id)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def api_error(request: Request, e: ApiError):
        return error_response(e, request.url.path)

    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; see /v1/chat/completions, "
                       "/v1/completions, /v1/messages, /v1/models, /health, /metrics")
        else:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(ApiError(e.status_code, message), request.url.path)

    async def server_error(request: Request, e: Exception):
        log.error("request to %s failed", request.url.path, exc_info=e)
        engine.metrics.request_done("failed")
        return error_response(ApiError(500, INTERNAL), request.url.path)

    chat = generation(openai.parse_chat, openai.Reply)
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),  # mlx-lm's server answers here too
        Route("/v1/completions", generation(openai.parse_completion, openai.Reply), methods=["POST"]),
        Route("/v1/messages", generation(anthropic.parse_messages, anthropic.Reply), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        ApiError: api_error, HTTPException: http_error, Exception: server_error})
    return ApiKey(app, api_key)


def _too_large(n: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {n} bytes, more than this server takes "
                         f"({limit}); send a shorter conversation")


def _iso(seconds: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class Server(uvicorn.Server):
    """uvicorn serving `app`; `on_ready(port)` runs once the socket is bound. Shutting down
    (Ctrl-C, SIGTERM, `should_exit`) first cancels every job, so open streams end at once."""

    def __init__(self, app, engine, host: str = "127.0.0.1", port: int = 8080, on_ready=None,
                 log_level: str = "warning"):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        lifespan="off", timeout_graceful_shutdown=5))
        self.engine, self.on_ready = engine, on_ready

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready(self.port)

    async def shutdown(self, sockets=None) -> None:
        self.engine.close(timeout=0)
        await super().shutdown(sockets)

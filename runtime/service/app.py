"""The HTTP surface: a FastAPI app over one `Service` (engine process + its client + prepare pool).

The event loop does I/O only, and what costs less than a thread hop. A request's body is read with a
size limit (checked on Content-Length before anything is read, and again while reading) and a read
timeout, handed to a worker thread to be parsed and tokenized (a small completion of token ids is
parsed on the loop: prepare.cheap), queued for the engine (or refused with 429 past `max_queue`), and
then either streamed as Server-Sent Events or answered once. Whatever the client does, its hang-up cancels its
engine requests, whose pages go back to the pool at once.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import GenerationDefaults
from . import prepare
from .chat import ChatTemplate
from .client import EngineClient
from .metrics import Metrics
from .outputs import Job, Outputs
from .protocol import APIError, model_card, now
from .text import Tokenizer
from .wire import EngineSpec

log = logging.getLogger("g4rt.serve")


@dataclass(frozen=True)
class ServiceConfig:
    """The service's policy knobs (the engine's capacity lives in the LLM's SchedulerConfig)."""

    served_model_name: str = "g4rt"
    max_queue: int = 1024  # requests not yet started by the engine beyond which new ones get 429
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    read_timeout_s: float = 30.0
    retry_after_s: int = 1
    prepare_threads: int = 4
    # completions with token-id prompts in bodies this small are prepared on the event loop (prepare.cheap)
    inline_prepare_bytes: int = 8192

    def __post_init__(self):
        for name in ("max_queue", "max_body_bytes", "prepare_threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.inline_prepare_bytes, int) or self.inline_prepare_bytes < 0:
            raise ValueError(f"inline_prepare_bytes must be an integer >= 0, got {self.inline_prepare_bytes!r}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be positive, got {self.read_timeout_s!r}")


class Service:
    """One engine process behind its client; `build_app(service)` is its HTTP front end.

    Constructing it starts the engine process and returns once that has built its LLM (warm-up then
    goes on there); EngineStartError says why a build failed. Generation is accepted once the engine's
    warm-up is done (`accepting`); readiness (`ready`, `/ready`) waits for `warm_up` as well."""

    WARM_ROUNDS = 3  # of each warm-up request (warm_up)

    def __init__(self, engine: EngineSpec, config: ServiceConfig = ServiceConfig(), tokenizer: Tokenizer | None = None,
                 template: ChatTemplate | None = None, defaults: GenerationDefaults = GenerationDefaults()):
        self.config = config
        self.metrics = Metrics()
        self.outputs = Outputs(tokenizer, self.metrics, lambda cids: self.engine.cancel(cids))
        self.engine = EngineClient(engine, self.metrics, self.outputs)
        self.ctx = prepare.Context(config.served_model_name, self.engine.info["max_model_len"], tokenizer, template,
                                   defaults)
        self.pool = ThreadPoolExecutor(config.prepare_threads, thread_name_prefix="g4rt-prepare")
        self.draining = False
        self.warm = False  # warm_up is done
        self.api_warmup_s: float | None = None
        self.created = now()

    @classmethod
    def from_dir(cls, engine: EngineSpec, model_dir, config: ServiceConfig = ServiceConfig(),
                 defaults: GenerationDefaults = GenerationDefaults()) -> "Service":
        """Tokenizer and chat template from a model or engine directory (either may be absent); `defaults`: what
        a request leaves out (the directory's generation_config.json as `g4rt serve` reads it, or none)."""
        return cls(engine, config, Tokenizer.from_dir(model_dir), ChatTemplate.from_dir(model_dir), defaults)

    def close(self) -> None:
        self.engine.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def accepting(self) -> bool:
        return self.engine.ready.is_set() and not self.draining and self.engine.failed is None

    @property
    def ready(self) -> bool:
        return self.accepting and self.warm

    def stats(self) -> dict:
        s = self.engine.stats
        return {"ready": self.ready, "draining": self.draining, "running": s.running, "waiting": s.waiting,
                "requests": s.requests, "free_frames": s.free, "frames": s.total, "warmup_s": self.engine.warmup_s,
                "api_warmup_s": self.api_warmup_s, "engine_error": self.engine.failed}

    async def warm_up(self, app) -> None:
        """Once the engine is warm, send `WARM_ROUNDS` of each kind of generation request (streamed and
        not; token ids, text, chat where a tokenizer and a template allow) through `app` in this process,
        then turn ready. The engine's warm-up (engine_loop.warm_up) drives the LLM directly: this one
        runs what a request runs besides, the API process's parsing, admission, formatting and SSE
        code and the engine loop's, whose first runs cost the first request after readiness more than
        later ones. They are real requests: /metrics counts them."""
        if not await self.engine.wait_ready():
            return
        t0 = time.perf_counter()
        key = {"authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        ids = list(range(16, 32))  # below any vocab size
        gen = {"max_tokens": 2, "ignore_eos": True, "temperature": 0}
        bodies = [("/v1/completions", {"prompt": ids, "stream": True, "stream_options": {"include_usage": True},
                                       "return_token_ids": True, **gen}),
                  ("/v1/completions", {"prompt": ids, **gen})]
        if self.ctx.tokenizer is not None:
            bodies.append(("/v1/completions", {"prompt": "Hello", "stream": True, **gen}))
            if self.ctx.template is not None:
                bodies.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                        "stream": True, **gen}))
        try:
            for _ in range(self.WARM_ROUNDS):
                for path, body in bodies:
                    if not self.accepting:  # draining, or the engine died: nothing to warm for
                        return
                    status = await asgi_post(app, path, json.dumps(body).encode(), key)
                    if status != 200:
                        log.warning("API warm-up: POST %s answered %d", path, status)
        except Exception:  # a bug here must not keep the service unready: it only costs the first request
            log.exception("API warm-up failed; ready without it")
        self.api_warmup_s = time.perf_counter() - t0
        self.warm = True
        self.metrics.ready.set(1)
        log.info("API warm-up done in %.2f s: %d requests", self.api_warmup_s, self.WARM_ROUNDS * len(bodies))

    # ---- one generation request ------------------------------------------------------------------
    async def generate(self, request: Request, prepare_fn) -> Response:
        if not self.accepting:
            raise APIError(503, "the server is draining" if self.draining else "the server is warming up",
                           code="not_ready", headers={"Retry-After": str(self.config.retry_after_s)})
        body = await read_body(request, self.config.max_body_bytes, self.config.read_timeout_s)
        loop = asyncio.get_running_loop()
        if prepare_fn is prepare.completion and prepare.cheap(body, self.config.inline_prepare_bytes):
            spec = prepare_fn(body, self.ctx)
        else:
            spec = await loop.run_in_executor(self.pool, prepare_fn, body, self.ctx)
        if self.engine.num_waiting() + len(spec.choices) > self.config.max_queue:
            raise APIError(429, f"more than {self.config.max_queue} requests are waiting; retry later",
                           code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
        job = Job(spec, self.ctx.model_name, loop, self.ctx.tokenizer)
        self.engine.submit(job)
        try:
            await job.accepted
        except asyncio.CancelledError:
            self.engine.cancel(job.cids())
            raise
        if spec.stream:
            return SSEResponse(job, self.engine.cancel)
        waiter = asyncio.ensure_future(_watch(request.receive))
        try:
            await asyncio.wait({job.result, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not job.result.done():  # the client hung up: stop its requests now
            self.engine.cancel(job.cids())
            return Response(status_code=499)
        status, data = job.result.result()
        return Response(data, status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, f"bad Content-Length {length!r}")
        if int(length) > limit:
            raise APIError(413, f"body of {int(length)} bytes exceeds the limit of {limit}", code="body_too_large",
                           headers={"Connection": "close"})
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"body exceeds the limit of {limit} bytes", code="body_too_large",
                               headers={"Connection": "close"})
            chunks.append(chunk)
    try:
        async with asyncio.timeout(timeout_s):  # no task of its own, unlike wait_for
            await read()
    except TimeoutError:
        raise APIError(408, f"body not received within {timeout_s} s", code="read_timeout",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


class SSEResponse(Response):
    """text/event-stream of a job's chunks; a hang-up (seen on receive or on send) cancels the job."""

    def __init__(self, job: Job, cancel):  # no body to render: the chunks come from Outputs
        self.job, self.cancel = job, cancel
        self.status_code, self.background = 200, None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_watch(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump.done():
                pump.cancel()
            if not pump.done() or pump.cancelled() or pump.exception() is not None:
                self.cancel(self.job.cids())

    async def _pump(self, send) -> None:
        while True:
            parts = await self.job.take()  # all that is ready, in one write
            end = parts[-1] is None
            await send({"type": "http.response.body", "body": b"".join(p for p in parts if p is not None),
                        "more_body": not end})
            if end:
                return


async def _watch(receive) -> None:
    """Returns when the client hangs up (ASGI's http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def asgi_post(app, path: str, body: bytes, headers: dict[str, str]) -> int:
    """POST `body` (JSON) to `app` in this process, as uvicorn would hand it a loopback request; read
    the whole response and return its status."""
    status, done = 0, asyncio.Event()
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": hdrs,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    await app(scope, receive, send)
    return status


class _Gate:
    """ASGI middleware: Bearer auth on /v1/* when an API key is set, and requests counted by endpoint
    and status (unknown paths share one label). Pure ASGI, so streams and hang-ups pass untouched.

    `fast` maps paths to handlers it serves itself for POST (the generation endpoints), without
    FastAPI's routing and the middleware below it: on a 2-core CPU those cost about as much per request
    as the rest of the request's event-loop work (runtime/results/README.md, "API process cost per
    step"), and a service at hundreds of streams starts several requests per engine step. Errors are
    answered as the app's exception handlers answer them."""

    def __init__(self, app, metrics: Metrics, paths: set[str], api_key: str | None, fast: dict | None = None):
        self.app, self.metrics, self.paths, self.fast = app, metrics, paths, fast or {}
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)
        if self.expected and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
                return await _error(err)(scope, receive, counted)
        handler = self.fast.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, counted)
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except APIError as e:
            response = _error(e)
        except Exception as e:
            response = _internal(request, e)
        await response(scope, receive, counted)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _internal(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
    return _error(APIError(500, f"internal error: {type(e).__name__}"))


def build_app(service: Service) -> FastAPI:
    cfg = service.config
    app = FastAPI(title="g4rt", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(APIError(e.status_code, msg, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        return _internal(request, e)

    @app.get("/health")
    async def health():
        if service.engine.failed:
            return JSONResponse({"status": "failed", "error": service.engine.failed}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return JSONResponse(service.stats(), status_code=200 if service.ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(service.ctx.model_name, service.ctx.max_model_len,
                                                      service.created)]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await service.generate(request, prepare.completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await service.generate(request, prepare.chat)

    generation = {"/v1/completions": completions, "/v1/chat/completions": chat}  # _Gate serves them unless CORS

    async def _text_endpoint(request: Request, fn):
        body = await read_body(request, cfg.max_body_bytes, cfg.read_timeout_s)
        out = await asyncio.get_running_loop().run_in_executor(service.pool, fn, body, service.ctx)
        return Response(json.dumps(out).encode(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _text_endpoint(request, prepare.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _text_endpoint(request, prepare.detokenize)

    if cfg.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    paths = {"/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
             "/detokenize"}
    app.add_middleware(_Gate, metrics=service.metrics, paths=paths, api_key=cfg.api_key,
                       fast=None if cfg.allowed_origins else generation)
    return app

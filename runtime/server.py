"""`g4rt serve`: the OpenAI-compatible service (runtime/service/) on uvicorn.

`Server` owns the listening socket (bound before warm-up ends, listen backlog >= 2,048 so a burst of
connections queues in the kernel instead of being reset) and the uvicorn server; the `Service` owns
the engine process. Readiness waits for the engine's warm-up, then for the API process's own
(`Service.warm_up`: requests through the app). SIGTERM or SIGINT drain: readiness turns 503 and new
requests are refused, running requests go on for `shutdown_timeout_s`, then whatever still runs is
ended with a final chunk (finish_reason "abort"), connections close, the engine process is stopped
and waited for, and `run()` returns 0. A second signal exits at once. A dead engine process also
shuts the server down, and `run()` returns 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from .service.app import Service, build_app

log = logging.getLogger("g4rt.serve")
MIN_BACKLOG = 2048


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (it re-raises the signal after shutdown, so the process
    would not exit 0); `Server` installs handlers that drain first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Server:
    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 8000, *, backlog: int = MIN_BACKLOG,
                 shutdown_timeout_s: float = 30.0, keep_alive_s: int = 5, access_log: bool = True):
        if backlog < MIN_BACKLOG:
            raise ValueError(f"backlog must be >= {MIN_BACKLOG} (bursts of connections), got {backlog}")
        if not shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s!r}")
        self.service = service
        self.shutdown_timeout_s = shutdown_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(backlog)
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = build_app(service)
        config = uvicorn.Config(self.app, lifespan="off", backlog=backlog, access_log=access_log,
                                timeout_keep_alive=keep_alive_s, log_config=None,
                                timeout_graceful_shutdown=int(shutdown_timeout_s) + 5)
        self.uvicorn = _Uvicorn(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._looping = threading.Event()  # the event loop runs: shutdown() can reach it
        self._thread: threading.Thread | None = None
        self.exit_code: int | None = None  # run()'s, once it returned

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shutdown(self) -> None:
        """Begin draining (any thread; idempotent); a second call forces the exit."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server stopped already
                self._loop.call_soon_threadsafe(self._begin_shutdown)

    def _begin_shutdown(self) -> None:
        if self.service.draining:
            self.uvicorn.force_exit = True
            return
        stats = self.service.engine.stats
        log.info("draining: %d running, %d waiting; up to %.0f s", stats.running, stats.waiting,
                 self.shutdown_timeout_s)
        self.service.draining = True
        self.service.engine.drain(self.shutdown_timeout_s)
        self.uvicorn.should_exit = True

    async def _main(self, signals: bool) -> None:
        self._loop = asyncio.get_running_loop()
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._begin_shutdown)
        engine = self.service.engine
        await engine.attach()  # an engine that died already is heard of at once (its end of file)
        self._looping.set()
        warm = asyncio.create_task(self.service.warm_up(self.app))
        try:
            await self.uvicorn.serve(sockets=[self.sock])
        finally:
            warm.cancel()
            await engine.detach()

    def run(self) -> int:
        """Serve until drained (blocking; signals are handled when called on the main thread). Returns 0,
        or 1 when the engine loop died (its traceback is in the log)."""
        self.service.engine.on_fatal = self.shutdown
        try:
            _run_loop(self._main(threading.current_thread() is threading.main_thread()))
        finally:
            self.service.close()
            self.sock.close()
        self.exit_code = 1 if self.service.engine.failed else 0
        return self.exit_code

    # ---- on a thread (tests, bench/api_cost.py) -----------------------------------------------------
    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.run, name="g4rt-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._looping.wait(timeout)
        self.shutdown()
        self._thread.join(timeout)


def _run_loop(main) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)

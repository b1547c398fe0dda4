"""Run the endpoints: one ServingEngine behind a grpc.aio server and an aiohttp server on one event loop.

`serve()` is what `jaxserve serve` runs: start both servers, wait for SIGTERM/SIGINT, then drain (health turns
NOT_SERVING, new requests get UNAVAILABLE / 503, in-flight requests finish or are aborted after
`drain_timeout_s`), stop the servers and the engine thread, and return 0. If the engine loop dies (an unrecoverable
engine failure: every request already got an error), it stops the same way at once and returns 1, so a supervisor
(systemd, Kubernetes) restarts the process instead of it idling unready.
`ServerThread` runs the same servers on a background thread's event loop (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import threading
from dataclasses import dataclass

import grpc
from aiohttp import web

from service.async_engine import ServingEngine
from service.grpc_server import build_grpc_server
from service.http_server import OpenAIServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int | None = 50051  # 0 = any free port; None = no gRPC server
    http_port: int | None = 8000  # 0 = any free port; None = no HTTP server
    api_key: str | None = None
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, both servers use TLS
    tls_key: str | None = None
    drain_timeout_s: float = 30.0


class Server:
    def __init__(self, serving: ServingEngine, cfg: ServerConfig):
        self.serving = serving
        self.cfg = cfg
        self.grpc_server: grpc.aio.Server | None = None
        self.http_runner: web.AppRunner | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        cfg = self.cfg
        if (cfg.tls_cert is None) != (cfg.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        await self.serving.start()
        if cfg.grpc_port is not None:
            self.grpc_server = build_grpc_server(self.serving, api_key=cfg.api_key)
            address = f"{cfg.host}:{cfg.grpc_port}"
            if cfg.tls_cert:
                with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                self.grpc_port = self.grpc_server.add_secure_port(address, creds)
            else:
                self.grpc_port = self.grpc_server.add_insecure_port(address)
            await self.grpc_server.start()
        if cfg.http_port is not None:
            app = OpenAIServer(self.serving, api_key=cfg.api_key).app
            self.http_runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await self.http_runner.setup()
            ctx = None
            if cfg.tls_cert:
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
            site = web.TCPSite(self.http_runner, cfg.host, cfg.http_port, ssl_context=ctx)
            await site.start()
            self.http_port = self.http_runner.addresses[0][1]

    async def stop(self, close_engine: bool = True) -> bool:
        """Drain, then close the servers (and the engine). True if no in-flight request had to be aborted."""
        clean = await self.serving.drain(self.cfg.drain_timeout_s) if close_engine else True
        if self.grpc_server is not None:
            await self.grpc_server.stop(1.0)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if close_engine:
            await self.serving.close()
        return clean


async def serve(serving: ServingEngine, cfg: ServerConfig) -> int:
    server = Server(serving, cfg)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dead: list[BaseException] = []

    def on_death(error: BaseException) -> None:  # engine thread
        dead.append(error)
        loop.call_soon_threadsafe(stop.set)

    serving.llm.add_death_callback(on_death)
    scheme = "https" if cfg.tls_cert else "http"
    parts = []
    if server.grpc_port is not None:
        parts.append(f"grpc {cfg.host}:{server.grpc_port}")
    if server.http_port is not None:
        parts.append(f"{scheme} {scheme}://{cfg.host}:{server.http_port}")
    ec = serving.llm.engine_config
    print(f"jaxserve: serving {serving.model_name} (weights: quantization={ec.quantization}, dtype={ec.dtype}) on "
          f"{', '.join(parts)}", flush=True)
    await stop.wait()
    if dead:
        print(f"jaxserve: the engine failed ({dead[0]}); stopping with exit status 1", flush=True)
        await server.stop(close_engine=False)
        return 1
    print("jaxserve: draining", flush=True)
    clean = await server.stop()
    print(f"jaxserve: stopped ({'all requests finished' if clean else 'some requests aborted at the drain timeout'})",
          flush=True)
    return 0


class ServerThread:
    """The servers on a background thread with its own event loop; `start()` returns once they listen."""

    def __init__(self, serving: ServingEngine, cfg: ServerConfig):
        self.server = Server(serving, cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="jaxserve-server", daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=60)
        return self

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, close_engine: bool = True) -> bool:
        try:
            return self.call(self.server.stop(close_engine), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    @property
    def grpc_port(self) -> int | None:
        return self.server.grpc_port

    @property
    def http_port(self) -> int | None:
        return self.server.http_port

"""Structured JSON logs with request ids, and the Prometheus metrics of the server."""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={"fields": {...}}`` adds keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sandboxes = Gauge("orchard_sandboxes", "Sandboxes by status", ["status"], registry=self.registry)
        self.create_seconds = Histogram("orchard_create_seconds", "Sandbox create latency", buckets=LATENCY_BUCKETS,
                                        registry=self.registry)
        self.exec_seconds = Histogram("orchard_exec_seconds", "Exec latency through the server (wait=true)",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)
        self.reconciler = Counter("orchard_reconciler_actions", "Reconciler actions", ["action"], registry=self.registry)
        self.errors = Counter("orchard_errors", "Errors returned, by type", ["type"], registry=self.registry)
        self.requests = Counter("orchard_requests", "HTTP requests by route and status", ["method", "status"],
                                registry=self.registry)


log = logging.getLogger("orchard.server")


class RequestLogMiddleware:
    """Gives every request an id (``X-Request-ID``, echoed back) and logs one line for it.
    Headers are never logged, so API keys cannot leak into logs."""

    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode(errors="replace")[:64]
        request_id = given or secrets.token_hex(8)
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = {"code": 500}

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.requests.labels(scope["method"], str(status["code"])).inc()
            if log.isEnabledFor(logging.INFO):
                log.info("request", extra={"fields": {
                    "request_id": request_id, "method": scope["method"], "path": scope["path"],
                    "status": status["code"], "ms": round((time.perf_counter() - start) * 1000, 2)}})

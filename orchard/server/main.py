"""Run the server: build backend, store and app from a config, serve with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from orchard.gc_tuning import tune_for_service
from orchard.server.app import create_app
from orchard.server.config import ServerConfig
from orchard.server.observability import Metrics, configure_logging
from orchard.server.reconciler import Reconciler
from orchard.server.service import ServerService

log = logging.getLogger("orchard.server")


def build_app(config: ServerConfig):
    """The app for ``config`` (tests and embedding use this without uvicorn)."""
    backend = config.make_backend()
    service = ServerService(config, backend, config.make_store(), Metrics())
    api_key = config.api_key.get_secret_value() if config.api_key else None
    return create_app(service, Reconciler(service, config.reconciler), api_key)


def serve(config: ServerConfig) -> None:
    configure_logging(config.log_level)
    app = build_app(config)
    if config.api_key is None:
        log.warning("no API key set: every caller is trusted (set --api-key or ORCHARD_API_KEY)")
    log.info("starting", extra={"fields": {"host": config.host, "port": config.port, "backend": config.backend.name,
                                           "state": str(config.state)}})
    tune_for_service()
    # proxy_headers off: nothing here reads the client's address, and rewriting it cost
    # about 2% of the server's CPU per call
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_keep_alive=60, backlog=4096, log_config=None, proxy_headers=False)

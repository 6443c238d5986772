"""Run the server: build backend, store and app from a config, serve with uvicorn."""

from __future__ import annotations

import logging
from typing import Optional

import uvicorn

from orchard.download_cut import quiet_download_cuts
from orchard.gc_tuning import tune_after_startup
from orchard.server.app import create_app
from orchard.server.config import ServerConfig
from orchard.server.connections import ConnectionGuard, raise_open_files_limit
from orchard.server.observability import Metrics, configure_logging
from orchard.server.reconciler import Reconciler
from orchard.server.service import ServerService

log = logging.getLogger("orchard.server")
STARTUP_FAILURE = 3  # uvicorn's exit status for a server that did not start


def build_app(config: ServerConfig, connections: Optional[ConnectionGuard] = None):
    """The app for ``config`` (tests and embedding use this without uvicorn)."""
    backend = config.make_backend()
    service = ServerService(config, backend, config.make_store(), Metrics())
    api_key = config.api_key.get_secret_value() if config.api_key else None
    return create_app(service, Reconciler(service, config.reconciler, connections), api_key)


def serve(config: ServerConfig) -> None:
    configure_logging(config.log_level)
    limit = raise_open_files_limit()
    if config.max_connections > limit - 256:
        log.warning("max_connections %d is near this process's open-files limit %d", config.max_connections, limit)
    connections = ConnectionGuard(config.max_connections, config.header_timeout)
    app = build_app(config, connections)
    if config.api_key is None:
        log.warning("no API key set: every caller is trusted (set --api-key or ORCHARD_API_KEY)")
    log.info("starting", extra={"fields": {"host": config.host, "port": config.port, "backend": config.backend.name,
                                           "state": str(config.state)}})
    # proxy_headers off: nothing here reads the client's address, and rewriting it cost
    # about 2% of the server's CPU per call
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           access_log=False, timeout_keep_alive=60, backlog=4096, log_config=None,
                                           proxy_headers=False, http=connections.protocol(),
                                           ssl_certfile=str(config.tls_cert) if config.tls_cert else None,
                                           ssl_keyfile=str(config.tls_key) if config.tls_key else None))
    quiet_download_cuts()
    tune_after_startup(server)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:  # as uvicorn.run: its exit status when it could not start (a port in use)
        raise SystemExit(STARTUP_FAILURE)

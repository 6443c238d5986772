"""The Python SDK (sync and async)."""

from orchard.client.aio import AsyncClient, AsyncSandbox
from orchard.client.sync import Client, SyncSandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "SyncSandbox"]

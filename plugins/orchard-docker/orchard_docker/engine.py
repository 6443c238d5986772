"""The Docker Engine API through the official ``docker`` SDK, made async and typed.

The SDK is synchronous (requests over the engine's socket), so each call runs in a thread,
bounded by ``api_timeout``. Engine failures become Orchard's typed errors: an engine that
does not answer is ``BackendUnavailable`` with the command that starts one, an image that
cannot be had is ``ImageRejected`` naming it, a name taken is ``SandboxConflict``.
Works with Docker Engine and Podman's Docker-compatible service (API 1.41 and later).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from orchard.errors import BackendUnavailable, ImageRejected, InvalidRequest, SandboxConflict


def start_hint(url: str) -> str:
    path = url.removeprefix("unix://")
    return (f"start an engine on {path}: systemctl start docker (Docker Engine), or "
            f"podman system service --time=0 unix://{path} & (Podman)")


class Engine:
    """One engine socket; the SDK client is made on first use."""

    def __init__(self, url: str, api_timeout: float, pull_timeout: float) -> None:
        self.url = url
        self.api_timeout = api_timeout
        self.pull_timeout = pull_timeout
        self._api: Any = None
        self._checked = False

    def _client(self, timeout: Optional[float] = None) -> Any:
        import docker

        try:
            return docker.APIClient(base_url=self.url, version="auto", timeout=timeout or self.api_timeout)
        except docker.errors.DockerException as exc:
            raise BackendUnavailable(f"the engine at {self.url} does not answer ({_short(exc)}); "
                                     f"{start_hint(self.url)}") from None

    async def call(self, method: str, *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        """``APIClient.<method>(*args, **kwargs)`` in a thread; None for a 404 when ``missing_ok``."""
        return await self._run(lambda api: getattr(api, method)(*args, **kwargs), missing_ok=missing_ok)

    async def _run(self, work: Callable[[Any], Any], *, missing_ok: bool = False, client: Any = None) -> Any:
        import docker
        import requests

        if client is None:
            await self.connect()
        try:
            return await asyncio.to_thread(work, client or self._api)
        except docker.errors.NotFound:
            if missing_ok:
                return None
            raise
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                raise SandboxConflict(f"engine: {_short(exc)}") from None
            if exc.status_code is not None and exc.status_code < 500:
                raise InvalidRequest(f"the engine refused the request: {_short(exc)}") from None
            raise BackendUnavailable(f"the engine failed: {_short(exc)}") from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, docker.errors.DockerException) as exc:
            raise BackendUnavailable(f"the engine at {self.url} did not answer: {_short(exc)}; "
                                     f"{start_hint(self.url)}") from None

    async def connect(self) -> None:
        """Connect once; refuse engines whose bind mounts do not share this host's files."""
        if self._checked:
            return
        self._api = await asyncio.to_thread(self._client)
        info = await self._run(lambda api: api.info(), client=self._api)
        if "docker desktop" in str(info.get("OperatingSystem", "")).lower():
            raise BackendUnavailable(f"the engine at {self.url} is Docker Desktop: its containers run in a VM, where a "
                                     "Unix socket in a bind-mounted directory cannot be reached from this host; this "
                                     "version of the docker backend needs an engine on this machine (Linux)")
        self._checked = True

    # -- images --------------------------------------------------------------------------
    async def image(self, reference: str, pull: str) -> dict[str, Any]:
        """The image's inspect document, pulled first when ``pull`` says so."""
        found = None if pull == "always" else await self.call("inspect_image", reference, missing_ok=True)
        if found is not None:
            return found
        if pull == "never":
            raise ImageRejected(f"image {reference!r} is not on the engine and the pull setting is 'never'")
        await self.pull(reference)
        found = await self.call("inspect_image", reference, missing_ok=True)
        if found is None:
            raise ImageRejected(f"image {reference!r}: pulled, yet the engine does not have it")
        return found

    async def pull(self, reference: str) -> None:
        import docker
        import requests

        puller = await asyncio.to_thread(self._client, self.pull_timeout)
        try:
            await asyncio.wait_for(asyncio.to_thread(lambda: _drain(puller.pull(reference, stream=True, decode=True))),
                                   self.pull_timeout)
        except asyncio.TimeoutError:
            raise ImageRejected(f"image {reference!r}: the pull took longer than {self.pull_timeout:g} s "
                                "(setting pull_timeout)") from None
        except (docker.errors.APIError, RuntimeError) as exc:
            raise ImageRejected(f"image {reference!r} could not be pulled: {_short(exc)}") from None
        except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
            raise BackendUnavailable(f"the engine at {self.url} did not answer a pull: {_short(exc)}; "
                                     f"{start_hint(self.url)}") from None
        finally:
            puller.close()

    async def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None
            self._checked = False


def _drain(stream: Any) -> None:
    """Read a pull's progress to its end; an error line fails it."""
    for line in stream:
        if isinstance(line, dict) and line.get("error"):
            raise RuntimeError(str(line.get("error")))


def _short(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip()
    return text[-600:]

"""``orchard doctor --backend docker``: the SDK, a local engine socket that answers (Docker
Engine or Podman's service), an engine on this machine (not Docker Desktop's VM), and the
agent bundle (or what building it needs). Each failure comes with the command that fixes it."""

from __future__ import annotations

import os
import stat
from typing import Any

from orchard.backends.checks import Check, module_check, tool_check
from orchard_docker.engine import start_hint


def _url(settings: dict[str, Any]) -> str:
    return str(settings.get("docker_host") or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock")


def socket_check(url: str) -> Check:
    if not url.startswith("unix://"):
        return Check("engine socket", False, f"{url} is a remote engine: this version needs a local socket",
                     "unset DOCKER_HOST (or set backend setting docker_host: unix:///PATH)")
    path = url.removeprefix("unix://")
    try:
        ok = stat.S_ISSOCK(os.stat(path).st_mode)
        detail = path if ok else f"{path} exists but is not a socket"
    except OSError as exc:
        ok, detail = False, f"{path}: {exc.strerror}"
    return Check("engine socket", ok, detail, None if ok else start_hint(url))


def engine_check(url: str, timeout: float = 10.0) -> Check:
    """The engine answers its API, and runs on this machine (bind mounts share our files)."""
    try:
        import docker

        api = docker.APIClient(base_url=url, version="auto", timeout=timeout)
        try:
            version, info = api.version(), api.info()
        finally:
            api.close()
    except Exception as exc:  # the SDK raises several kinds for "nobody answers"
        return Check("engine API", False, f"{url}: {str(exc)[-300:]}", start_hint(url))
    system = str(info.get("OperatingSystem", ""))
    if "docker desktop" in system.lower():
        return Check("engine API", False, f"{system}: containers run in a VM; this version needs a local Linux engine",
                     "use Docker Engine or Podman on Linux (apt-get install podman)")
    return Check("engine API", True, f"{version.get('Version', '?')} (API {version.get('ApiVersion', '?')}), {system}")


def bundle_check(settings: dict[str, Any]) -> Check:
    named = settings.get("bundle_dir")
    if named:
        ok = os.path.exists(os.path.join(str(named), "orchard-bundle.json"))
        return Check("agent bundle", ok, str(named) if ok else f"{named} holds no agent bundle",
                     None if ok else f"orchard agent bundle --out {named}")
    found = tool_check("cc", "apt-get install -y gcc", why="the agent bundle is built on first use")
    return Check("agent bundle", found.ok, "built on first use" if found.ok else found.detail, found.fix)


def docker_checks(settings: dict[str, Any]) -> list[Check]:
    url = _url(settings)
    checks = [module_check("docker", "pip install docker"), socket_check(url)]
    if checks[-1].ok and checks[0].ok:
        checks.append(engine_check(url))
    return checks + [bundle_check(settings)]

"""The built-in image policy (an ``orchard_verify_image`` implementation like any plugin's).

An image decides what a sandbox sees, and a directory image is copied by the agent with
its own privileges, so images come only from places the operator named:
- directory images from the configured image directories (default: ``STATE/rootfs``),
  never from inside the agent's state directory (its token, other sandboxes' layers);
- ``docker://`` images from the allowed registries (a host, or host:port; a host alone
  allows any port), so a caller cannot make the agent probe internal addresses;
- ``oras://``, ``library://`` and ``shub://`` images (pulled by Apptainer on Slurm pilots)
  from the allowed registries too; one that names no host comes from Apptainer's configured
  default remote, which the agent cannot see, so only ``registries: ['*']`` allows it;
- where ``image_digests`` is set, only ``docker://`` images pinned by one of those digests
  (skopeo checks the pulled manifest against the digest it was asked for);
- no other scheme: a runtime's puller would go wherever it points.
Other plugins may refuse more; any refusal wins.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from orchard.hookspecs import hookimpl

DEFAULT_REGISTRIES = ("docker.io", "ghcr.io", "quay.io", "registry.k8s.io", "gcr.io", "nvcr.io", "public.ecr.aws",
                      "mcr.microsoft.com", "registry.gitlab.com")
ANY_REGISTRY = "*"


def registry_of(reference: str) -> str:
    """The registry host[:port] of ``docker://REF``, as Docker reads it (docker.io when
    the first component names no host)."""
    name = reference.removeprefix("docker://").split("@", 1)[0]
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first.lower()
    return "docker.io"


def registry_allowed(registry: str, allowed: list[str]) -> bool:
    host = registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry
    for entry in allowed:
        entry = entry.lower()
        if entry == ANY_REGISTRY or entry == registry or (":" not in entry and entry == host):
            return True
    return registry == "docker.io" and "registry-1.docker.io" in allowed


APPTAINER_SCHEMES = ("oras://", "library://", "shub://")
PLAIN_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?|\[[0-9a-f:.]+\](:[0-9]{1,5})?")


def remote_host(reference: str) -> Optional[str]:
    """The host an ``oras://``, ``library://`` or ``shub://`` reference is pulled from, or None
    where it names none (``library://entity/collection/image``: Apptainer's default remote)."""
    scheme, _, rest = reference.partition("://")
    first, _, tail = rest.partition("/")
    if scheme == "oras" or (tail and ("." in first or ":" in first or first == "localhost")):
        return first.lower()
    return None


def remote_refusal(image: str, policy: dict[str, Any]) -> Optional[str]:
    scheme = image.split("://", 1)[0]
    if policy.get("image_digests"):
        return f"only docker:// images pinned by digest are allowed, not {scheme}:// (setting image_digests)"
    allowed = list(policy.get("registries", DEFAULT_REGISTRIES))
    host = remote_host(image)
    if host is not None and not PLAIN_HOST.fullmatch(host):  # "allowed:443@evil" is evil's to a URL parser
        return f"{scheme}:// image host {host[:80]!r} is not a plain host[:port]"
    if host is None:
        if ANY_REGISTRY in allowed:
            return None
        return (f"a {scheme}:// image that names no host comes from Apptainer's default remote, which only "
                "registries: ['*'] allows; name the host (setting registries)")
    if not registry_allowed(host, allowed):
        return f"registry {host!r} is not in the allowed registries (setting registries)"
    return None


def repository(reference: str) -> str:
    """``HOST/PATH`` of ``docker://HOST/PATH[:TAG][@DIGEST]``."""
    name = reference.removeprefix("docker://").split("@", 1)[0]
    head, slash, last = name.rpartition("/")
    return f"{head}{slash}{last.split(':', 1)[0]}"


def digest_of(reference: str) -> Optional[str]:
    """The digest a ``docker://NAME[:TAG]@DIGEST`` reference is pinned by, if any."""
    name = reference.removeprefix("docker://")
    return name.split("@", 1)[1].lower() if "@" in name else None


def digest_refusal(image: str, allowed: list[str]) -> Optional[str]:
    digest = digest_of(image)
    if digest is None:
        return "only images pinned by digest (IMAGE@sha256:...) are allowed (setting image_digests)"
    if digest not in {entry.lower() for entry in allowed}:
        return f"digest {digest[:80]!r} is not in the allowed image digests (setting image_digests)"
    return None


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def directory_refusal(image: str, image_dirs: list[str], protected: list[str]) -> Optional[str]:
    path = image.removeprefix("dir://")
    if not os.path.isabs(path):
        return None  # the image store explains relative paths
    real = os.path.realpath(path)
    for directory in protected:
        guarded = os.path.realpath(directory)
        if _inside(real, guarded) or _inside(guarded, real):
            return "directory images may not include the agent's or server's state"
    allowed = [os.path.realpath(d) for d in image_dirs]
    if not any(_inside(real, directory) for directory in allowed):
        where = ", ".join(allowed) or "(none configured)"
        return f"directory images must lie in the configured image directories: {where} (setting image_dirs)"
    return None


@hookimpl
def orchard_verify_image(image: str, policy: dict[str, Any]) -> Optional[str]:
    if image == "host":
        return None
    if image.startswith("docker://"):
        registry = registry_of(image)
        allowed = list(policy.get("registries", DEFAULT_REGISTRIES))
        if not registry_allowed(registry, allowed):
            return f"registry {registry!r} is not in the allowed registries (setting registries)"
        digests = list(policy.get("image_digests") or [])
        return digest_refusal(image, digests) if digests else None
    if image.startswith(APPTAINER_SCHEMES):
        return remote_refusal(image, policy)
    if "://" in image and not image.startswith("dir://"):
        return (f"image scheme {image.split('://', 1)[0][:40]!r} is not supported: use 'host', a directory, "
                "dir://, docker://, oras://, library:// or shub://")
    return directory_refusal(image, list(policy.get("image_dirs", [])), list(policy.get("protected_dirs", [])))

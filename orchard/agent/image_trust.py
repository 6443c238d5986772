"""What skopeo is told to trust on a pull, and cache keys that keep checked images apart.

With ``signature_policy`` set (a containers-policy.json), skopeo checks signatures on every
pull. The image cache is keyed by digest and a cached image is not pulled again, so the key
must also carry what the check depended on: the policy, the keys and signature locations it
names, and the repository (a policy is scoped per repository, and a signature binds a
digest to one repository name). Otherwise an image cached under no policy, under an older
key, or from a repository the policy accepts unsigned would pass for one checked here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from orchard.agent.image_policy import repository
from orchard.errors import RuntimeUnavailable

# containers-policy.json(5): the files signedBy and sigstoreSigned requirements name
KEY_FIELDS = ("keyPath", "keyPaths", "rekorPublicKeyPath", "caPath")


def _key_files(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for name, value in node.items():
            if name in KEY_FIELDS:
                values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
                yield from (v for v in values if isinstance(v, str))
            else:
                yield from _key_files(value)
    elif isinstance(node, list):
        for item in node:
            yield from _key_files(item)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RuntimeUnavailable(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None


class ImageTrust:
    def __init__(self, policy: dict[str, Any]) -> None:
        self.options = [f"--{option}={policy[name]}" for name, option in
                        (("signature_policy", "policy"), ("registries_d", "registries.d")) if policy.get(name)]
        self.fingerprint: Optional[str] = None
        if policy.get("signature_policy"):
            self.fingerprint = self._fingerprint(Path(policy["signature_policy"]),
                                                 Path(policy["registries_d"]) if policy.get("registries_d") else None)

    @staticmethod
    def _fingerprint(policy_file: Path, registries_d: Optional[Path]) -> str:
        """A hash of the policy, every key file it names and the registries.d files (read once,
        at the agent's start: restart it after changing them)."""
        digest = hashlib.sha256()
        text = _read(policy_file, "signature_policy")
        digest.update(text)
        try:
            named = sorted(set(_key_files(json.loads(text))))
        except ValueError as exc:
            raise RuntimeUnavailable(f"signature_policy {str(policy_file)!r} is not JSON: {exc}") from None
        for key in named:
            digest.update(f"\0{key}\0".encode() + _read(Path(key), "the key file"))
        if registries_d is not None:
            for path in sorted(p for p in registries_d.rglob("*") if p.is_file()):
                digest.update(f"\0{path}\0".encode() + _read(path, "the registries.d file"))
        return digest.hexdigest()

    def cache_name(self, digest: str, reference: str) -> str:
        """The cache directory's name for ``reference`` pulled at ``digest``."""
        name = digest.replace(":", "-")
        if self.fingerprint is None:
            return name
        scope = hashlib.sha256(f"{self.fingerprint}\0{repository(reference)}".encode()).hexdigest()[:16]
        return f"{name}-trust-{scope}"

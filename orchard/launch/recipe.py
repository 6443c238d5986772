"""A training launch from one YAML file, the same on Slurm and on Kubernetes.

Everything that differs between the platforms is the file's ``platform`` section (where
files live, how the server is reached, which sandbox backend the server runs); the sbatch
script and the Kubernetes manifests only run ``orchard launch serve`` and ``orchard launch
train`` with the file's path. So ``slurm/launch.yaml`` and ``k8s/launch/launch.yaml`` differ
in ``platform`` and nowhere else (``tests/launch/test_recipes.py`` diffs them).

```yaml
platform:
  workdir: /scratch/me/rl        # every node sees it; the commands run here, relative paths resolve here
  advertise: fqdn                # how trainers reach the server: fqdn (Slurm) or ip (pods)
  slime_dir: /opt/slime          # slime's git checkout (trainer: slime)
  wait_seconds: 600              # how long the trainer waits for the server
  backend: {name: slurm, settings: {partition: cpu, shared_dir: /scratch/me/rl/shared}}
server: {port: 8000, log_level: info, reconciler: {interval: 10}}   # orchard serve, less backend
trainer: standalone              # or slime
rl: {model: sft-final, tasks: tasks.jsonl, output_dir: rl, ...}     # orchard train rl, less backend
slime: {orchard: {...}, args: [...]}   # ORCHARD_SLIME_CONFIG (less server) and slime's train.py flags
```
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KEYS = {"platform", "server", "trainer", "rl", "slime"}
PLATFORM_KEYS = {"workdir", "advertise", "slime_dir", "wait_seconds", "backend"}
TRAINERS = ("standalone", "slime")
# slime's flags that route its rollouts and advantages through Orchard (docs/training-at-scale.md)
SLIME_FLAGS = {"--rollout-function-path": "orchard.integrations.slime.generate_rollout",
               "--custom-reward-post-process-path": "orchard.integrations.slime.reward_post_process"}


@dataclass
class Recipe:
    data: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> "Recipe":
        data = yaml.safe_load(Path(path).read_text()) or {}
        problems = sorted(set(data) - KEYS) + sorted(set(data.get("platform", {})) - PLATFORM_KEYS)
        if problems:
            raise ValueError(f"{path}: unknown key(s) {problems}")
        if "workdir" not in data.get("platform", {}):
            raise ValueError(f"{path}: platform.workdir is required")
        if data.get("trainer", "standalone") not in TRAINERS:
            raise ValueError(f"{path}: trainer must be one of {TRAINERS}")
        return cls(data)

    @property
    def platform(self) -> dict[str, Any]:
        return self.data["platform"]

    @property
    def trainer(self) -> str:
        return self.data.get("trainer", "standalone")

    @property
    def workdir(self) -> Path:
        return Path(self.platform["workdir"])

    @property
    def launch_dir(self) -> Path:
        """The server's config, state and URL file: one launch per workdir."""
        return self.workdir / "launch"

    @property
    def url_file(self) -> Path:
        return self.launch_dir / "service.url"

    @property
    def port(self) -> int:
        return int(self.data.get("server", {}).get("port", 8000))

    def server_config(self) -> dict[str, Any]:
        """``orchard serve``'s config: the ``server`` section with the platform's backend (no API
        key in the file: the server reads ``ORCHARD_API_KEY``)."""
        return {"host": "0.0.0.0", "state": str(self.launch_dir / "server.db"), **self.data.get("server", {}),
                "backend": self.platform.get("backend", {"name": "local"})}

    def advertised_url(self) -> str:
        host = socket.getfqdn()
        if self.platform.get("advertise", "fqdn") == "ip":
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{host}:{self.port}"

    def rl_config(self, url: str) -> dict[str, Any]:
        """``orchard train rl``'s config: sandboxes through the launch's server, agents called directly."""
        return {**self.data.get("rl", {}), "backend": {"url": url, "direct": True}}

    def slime_settings(self, url: str, api_key: str | None) -> dict[str, Any]:
        """``ORCHARD_SLIME_CONFIG``'s content: the ``slime.orchard`` section and the launch's server."""
        return {**self.data.get("slime", {}).get("orchard", {}), "server_url": url, "api_key": api_key}

    def slime_command(self) -> list[str]:
        """slime's ``train.py`` with the file's flags, plus Orchard's rollout flags where missing."""
        args = [str(a) for a in self.data.get("slime", {}).get("args", [])]
        for flag, value in SLIME_FLAGS.items():
            if flag not in args:
                args += [flag, value]
        return [sys.executable, str(Path(self.platform.get("slime_dir", "slime")) / "train.py"), *args]

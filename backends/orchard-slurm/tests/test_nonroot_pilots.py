"""Pilots as an ordinary user, as on a real site: the service runs as a non-root user, its
pilot jobs run as that user, and the agent's bubblewrap sandboxes still get their own user,
PID and network namespaces (unprivileged user namespaces)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from slurm_testing import slurm_settings, wait_until_no_jobs

USER = "orchard-nonroot"
SCRIPT = """
import json, os, subprocess, sys
from pathlib import Path
from typing import Iterator
from orchard.client import Client
settings = json.loads(sys.argv[1])
client = Client(backend="slurm", backend_settings=settings)
result = {}
with client.create() as first, client.create() as second:
    result["ids"] = first.exec("id -u; id -g").stdout.split()
    first.exec("sleep 1000 & echo started")
    result["isolated"] = "sleep 1000" not in second.exec("ps -ef").stdout
    result["blocked"] = first.exec("grep -c : /proc/net/dev").stdout.strip()
    record = next(Path(settings["shared_dir"]).glob("pilots/*/agent/agent.json"))
    result["agent_uid"] = os.stat(f"/proc/{json.loads(record.read_text())['pid']}").st_uid
    result["job_users"] = subprocess.run(["squeue", "-h", "-n", settings["job_name"], "-o", "%u"],
                                         capture_output=True, text=True).stdout.split()
client.close()
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def ordinary_user() -> int:
    """A login-less user (created once), who runs the service and so the pilots."""
    if os.geteuid() != 0:
        pytest.fail("this test makes an ordinary user: run the suite as root (make test does)")
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
        return pwd.getpwnam(USER).pw_uid


@pytest.fixture(scope="module")
def user_python() -> Iterator[Path]:
    """A Python the user can run with this checkout's packages: our interpreter may live
    under /root (pyenv), which others cannot enter, so a venv of the system's Python of the
    same version that adds our site-packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system_python = Path("/usr/bin") / version
    if not system_python.exists():
        pytest.fail(f"{system_python} is missing (make system-deps installs python3)")
    venv = Path(tempfile.mkdtemp(prefix="orchard-nonroot-venv-", dir="/tmp"))
    subprocess.run([str(system_python), "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    site_packages = sysconfig.get_paths()["purelib"]
    (venv / "lib" / version / "site-packages" / "orchard-checkout.pth").write_text(
        f"import site; site.addsitedir({site_packages!r})\n")
    subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
    yield venv / "bin" / "python"
    shutil.rmtree(venv, ignore_errors=True)


def test_pilots_of_an_ordinary_user_isolate_sandboxes(slurm_cluster, ordinary_user, user_python):
    settings = slurm_settings(pilot_idle_seconds=0)
    shared = Path(settings["shared_dir"])
    os.chown(shared, ordinary_user, ordinary_user)
    try:
        result = subprocess.run(["runuser", "-u", USER, "--", str(user_python), "-c", SCRIPT, json.dumps(settings)],
                                capture_output=True, text=True, timeout=120, cwd="/tmp")
        assert result.returncode == 0, result.stderr[-3000:]
        found = json.loads(result.stdout.strip().splitlines()[-1])
        assert found["job_users"] == [USER]  # the pilot job is the user's, not root's
        assert found["agent_uid"] == ordinary_user
        assert found["ids"] == ["1000", "1000"]  # the sandbox's own uid inside its user namespace
        assert found["isolated"] and found["blocked"] == "1"
        assert wait_until_no_jobs(settings["job_name"]) == []
    finally:
        subprocess.run(["scancel", "-n", settings["job_name"]], check=False)

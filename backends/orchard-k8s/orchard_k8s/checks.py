"""``orchard doctor --backend k8s``: the kubernetes client, and credentials to reach a cluster
(the kubeconfig the settings name, or the in-cluster service account when none is named)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchard.backends.checks import Check, module_check

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def kubeconfig_check(settings: dict[str, Any]) -> Check:
    """The backend reads ``settings.kubeconfig``, else the in-cluster service account."""
    named = settings.get("kubeconfig")
    if named:
        path = Path(os.path.expanduser(str(named)))
        ok = path.is_file() and os.access(path, os.R_OK)
        return Check("kubeconfig", ok, str(path) if ok else f"{path} is not a readable file",
                     None if ok else f"kind export kubeconfig --kubeconfig {path} (or copy your cluster's kubeconfig there)")
    ok = SERVICE_ACCOUNT.is_file() and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    default = Path.home() / ".kube" / "config"
    hint = f"set backend setting kubeconfig: {default}" if default.is_file() else (
        "set backend setting kubeconfig: FILE (e.g. from kind export kubeconfig), or run inside a pod")
    return Check("cluster credentials", ok, "in-cluster service account" if ok else
                 "no kubeconfig setting and no in-cluster service account", None if ok else hint)


def k8s_checks(settings: dict[str, Any]) -> list[Check]:
    return [module_check("kubernetes", "pip install kubernetes"), kubeconfig_check(settings)]

"""Reading a pod's status: ready, failing to start (and why), or lost (and why)."""

from __future__ import annotations

from typing import Any, Optional

PULL_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerError",
               "RunContainerError", "CrashLoopBackOff")


def container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def condition(pod: dict[str, Any], kind: str) -> Optional[dict[str, Any]]:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def is_ready(pod: Optional[dict[str, Any]]) -> bool:
    ready = condition(pod, "Ready") if pod else None
    return bool(ready and ready.get("status") == "True" and (pod.get("status") or {}).get("podIP"))


def start_failure(pod: dict[str, Any]) -> Optional[str]:
    """Why a pod will not start (an image that cannot be pulled, a container that cannot run),
    as the kubelet says it; None while it may still start."""
    for status in container_statuses(pod):
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in PULL_ERRORS:
            return f"{waiting['reason']}: {waiting.get('message') or 'no message'} (container {status.get('name')})"
    return lost_reason(pod)


def unschedulable(pod: dict[str, Any]) -> Optional[str]:
    scheduled = condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return f"Unschedulable: {scheduled.get('message') or 'no node fits'}"
    return None


def lost_reason(pod: Optional[dict[str, Any]]) -> Optional[str]:
    """Why a pod that ran no longer serves its sandbox (evicted, OOM-killed, its node lost,
    preempted, deleted); None while it is fine."""
    if pod is None:
        return "its pod was deleted"
    status, metadata = pod.get("status") or {}, pod.get("metadata") or {}
    disruption = condition(pod, "DisruptionTarget")
    if disruption and disruption.get("status") == "True":
        return f"its pod was disrupted: {disruption.get('reason')}: {disruption.get('message') or ''}".rstrip(": ")
    for container in container_statuses(pod):
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            said = f": {terminated['message'].strip()[-800:]}" if terminated.get("message") else ""
            return (f"its pod's {container.get('name')} container ended: {terminated.get('reason') or 'Terminated'}"
                    f" (exit code {terminated.get('exitCode')}){said}")
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"its pod ended: {status.get('reason') or status['phase']}: {status.get('message') or ''}".rstrip(": ")
    if metadata.get("deletionTimestamp"):
        return "its pod is being deleted"
    return None

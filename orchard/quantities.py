"""Kubernetes-style resource quantities ("2000m" CPUs, "16Gi" memory), parsed once.

Values are checked here, where they enter: a number that is not finite, a fraction of a
byte, or a limit no sandbox can run under is a ValueError (422 at the API), never a crash or
a silently missing limit later in the runtime.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
# Plain decimals only: no exponent, no inf/nan, no underscores (float() takes all three).
_NUMBER = r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-z]*)\s*$")
_CPU = re.compile(rf"^\s*({_NUMBER})\s*(m?)\s*$")
_MAX_TEXT = 64  # longer than any sensible quantity
# The accepted forms, for the API schema (the ranges are checked by the parsers below).
CPU_PATTERN = r"^\s*\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*m?\s*$"
QUANTITY_PATTERN = r"^\s*\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?\s*$"

CPU_MIN, CPU_MAX = Decimal("0.01"), Decimal(1024)
MEMORY_MIN, MEMORY_MAX = 16 * 2**20, 64 * 2**40  # 16Mi .. 64Ti
DISK_MIN, DISK_MAX = 2**20, 64 * 2**40  # 1Mi .. 64Ti
PIDS_MIN, PIDS_MAX = 16, 4_194_304  # the kernel's PID_MAX_LIMIT
PIDS_RULE = f"pids must be a whole number between {PIDS_MIN} and {PIDS_MAX}"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: object) -> Optional[str]:
    """The quantity as text, or None for what is no quantity (bools, other types, overlong)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    text = str(value)
    return text if len(text) <= _MAX_TEXT else None


def parse_cpu(value: str | int | float) -> float:
    """CPUs as a float: "4" -> 4.0, "2000m" -> 2.0; between 0.01 and 1024."""
    text = _text(value)
    match = _CPU.match(text) if text is not None else None
    cpus = Decimal(match.group(1)) / (1000 if match.group(2) else 1) if match else None
    if cpus is None or not CPU_MIN <= cpus <= CPU_MAX:
        raise ValueError(f"cpu must be between {CPU_MIN} and {CPU_MAX} CPUs, like '2' or '500m'; got {_show(value)}")
    return float(cpus)


def parse_bytes(value: str | int, what: str = "size") -> int:
    """Bytes as an int: "16Gi" -> 17179869184, "512M" -> 512000000, 1024 -> 1024.
    A positive whole number of bytes; no range (see parse_memory, parse_disk)."""
    text = _text(value)
    match = _QUANTITY.match(text) if text is not None else None
    if not match:
        raise ValueError(f"{what} must look like '16Gi' or '512Mi', got {_show(value)}")
    unit = match.group(2)
    multiplier = _BINARY.get(unit) or _DECIMAL.get(unit)
    if multiplier is None:
        raise ValueError(f"unknown {what} unit {unit!r} in {_show(value)} (use Ki, Mi, Gi, Ti, k, M, G, T)")
    try:
        size = Decimal(match.group(1)) * multiplier
    except InvalidOperation:  # pragma: no cover - the pattern admits only plain decimals
        raise ValueError(f"{what} must look like '16Gi' or '512Mi', got {_show(value)}") from None
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {_show(value)}")
    if size != size.to_integral_value():
        raise ValueError(f"{what} must be a whole number of bytes, got {_show(value)}")
    return int(size)


def _sized(value: str | int, what: str, low: int, high: int, range_text: str) -> int:
    try:
        size: Optional[int] = parse_bytes(value, what)
    except ValueError:
        size = None
    if size is None or not low <= size <= high:
        raise ValueError(f"{what} must be a whole number of bytes between {range_text}, like '512Mi' or '16Gi'; "
                         f"got {_show(value)}")
    return size


def parse_memory(value: str | int) -> int:
    """A memory limit in bytes, between 16Mi and 64Ti."""
    return _sized(value, "memory", MEMORY_MIN, MEMORY_MAX, "16Mi and 64Ti")


def parse_disk(value: str | int) -> int:
    """A writable-layer quota in bytes, between 1Mi and 64Ti."""
    return _sized(value, "disk", DISK_MIN, DISK_MAX, "1Mi and 64Ti")


def check_pids(value: int) -> int:
    """A process limit between 16 and 4194304."""
    if isinstance(value, bool) or not isinstance(value, int) or not PIDS_MIN <= value <= PIDS_MAX:
        raise ValueError(f"{PIDS_RULE}, got {_show(value)}")
    return value


def optional_bytes(value: Optional[str]) -> Optional[int]:
    """``parse_bytes`` for a setting that may be unset."""
    return parse_bytes(value) if value else None

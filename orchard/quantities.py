"""Kubernetes-style resource quantities ("2000m" CPUs, "16Gi" memory), parsed once."""

from __future__ import annotations

import re
from typing import Optional

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_cpu(value: str | int | float) -> float:
    """CPUs as a float: "4" -> 4.0, "2000m" -> 2.0."""
    text = str(value).strip()
    try:
        cpus = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(f"cpu must look like '2' or '500m', got {value!r}") from None
    if cpus <= 0:
        raise ValueError(f"cpu must be positive, got {value!r}")
    return cpus


def parse_bytes(value: str | int) -> int:
    """Bytes as an int: "16Gi" -> 17179869184, "512M" -> 512000000, 1024 -> 1024."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"size must look like '16Gi' or '512Mi', got {value!r}")
    number, unit = float(match.group(1)), match.group(2)
    if unit in _BINARY:
        size = number * _BINARY[unit]
    elif unit in _DECIMAL:
        size = number * _DECIMAL[unit]
    else:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use Ki, Mi, Gi, k, M, G)")
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return int(size)


def optional_bytes(value: Optional[str]) -> Optional[int]:
    """``parse_bytes`` for a setting that may be unset."""
    return parse_bytes(value) if value else None

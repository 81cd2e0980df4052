"""Sizes as people read them."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """`1536` -> `1.5 KB` (binary steps, as du -h counts)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)

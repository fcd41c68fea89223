"""Writing result files so that a killed process never leaves a half-written one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to a temporary sibling, then rename it over ``path`` (creating its folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(temporary, path)
    return path

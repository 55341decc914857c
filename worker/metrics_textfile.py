"""Cron mode: write every metric family of contract section 6 for node-exporter.

node-exporter's textfile collector reads ``*.prom`` files from a directory at any
moment, so the file is never written in place: the exposition text goes to a temporary
file in the same directory, is flushed to disk, and is renamed over the target. A
reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

# Importing the module registers every family, so an idle run still exposes them all.
import worker.metrics  # noqa: F401

__all__ = ["render", "write_textfile"]


def render(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The text exposition of ``registry`` (by default, this process's families)."""
    data: bytes = generate_latest(registry)
    return data


def write_textfile(path: Path, registry: CollectorRegistry = REGISTRY) -> None:
    """Atomically replace ``path`` with the current values of every family.

    The parent directory must exist. The file is world-readable (0644), as the
    collector usually runs as another user. On any error the target is left as it was
    and the temporary file is removed.
    """
    path = Path(path)
    data = render(registry)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.chmod(0o644)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk too.
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    # Some filesystems refuse fsync on a directory; the rename itself still happened.
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)
    os.close(dir_fd)

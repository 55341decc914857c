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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

# Importing the module registers every family, so an idle run still exposes them all.
import worker.metrics  # noqa: F401
from worker.metrics_server import initialise_label_sets

__all__ = ["render", "write_textfile"]

PREFIX = "dream_"


class _ReverieFamilies:
    """Only Reverie's families: a finished cron process's GC and CPU figures mean nothing."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        for family in self._source.collect():
            if family.name.startswith(PREFIX):
                yield family


def render(source: CollectorRegistry = REGISTRY) -> bytes:
    """The text exposition of every ``dream_*`` family in ``source`` (default: this process)."""
    initialise_label_sets()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReverieFamilies(source))
    data: bytes = generate_latest(registry)
    return data


def write_textfile(path: Path, source: CollectorRegistry = REGISTRY) -> None:
    """Atomically replace ``path`` with the current values of every family.

    The parent directory must exist. The file is world-readable (0644), as the
    collector usually runs as another user. On any error the target is left as it was
    and the temporary file is removed.
    """
    path = Path(path)
    data = render(source)
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

"""Cron mode: write every metric family (docs/reference.md, Metrics) for node-exporter.

node-exporter's textfile collector reads ``*.prom`` files from a directory at any
moment, so the file is never written in place: the exposition text goes to a temporary
file in the same directory, is flushed to disk, and is renamed over the target. A
reader sees the old file or the new one, never half of either.

Counters and histograms in the file are cumulative across runs, as Prometheus'
``increase()`` and ``rate()`` expect: each write adds what this process counted since
its last write to the values the file already holds. The file itself is the running
total, so nothing else has to survive between runs: a run that crashes before writing
loses only its own counts, and a deleted file starts again from zero (a counter reset,
which Prometheus handles). Concurrent writers take turns on a lock on the directory.
Gauges are the current values.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# Importing the module registers every family, so an idle run still exposes them all.
import worker.metrics  # noqa: F401
from worker.metrics_server import initialise_label_sets

__all__ = ["render", "unwritable", "write_textfile"]

PREFIX = "dream_"
#: Families whose samples only grow; ``_created`` is when the series began, kept from the first run.
CUMULATIVE = ("counter", "histogram")
CREATED = "_created"

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]
#: What this process has already added to each file, per (file, registry): written - base.
_contributed: dict[tuple[str, int], dict[_SampleKey, float]] = {}


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


def unwritable(path: Path) -> str | None:
    """Why :func:`write_textfile` cannot write ``path`` (checked before any work is done,
    so a pass is not run for a file it cannot report to); None if it can."""
    path = Path(path)
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists() and not path.is_file():
        # A device (/dev/null), a pipe or a socket: the write replaces the file by
        # renaming over it, which would put a regular file in a device's place.
        return "is not a regular file (a device, pipe or socket)"
    if not path.parent.is_dir():
        return f"its directory {path.parent} does not exist"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"its directory {path.parent} is not writable"
    return None


def write_textfile(path: Path, source: CollectorRegistry = REGISTRY, *, model: str | None = None) -> None:
    """Atomically replace ``path`` with every family: counters and histograms added to
    the totals already in the file, gauges as they are now.

    The parent directory must exist. The file is world-readable (0644), as the
    collector usually runs as another user. On any error the target is left as it was
    and the temporary file is removed. ``model`` (the configured model) gives the
    ``dream_llm_*`` families their series from the first pass, as the worker's page has.
    """
    path = Path(path)
    initialise_label_sets(model)
    owner = (str(path.resolve()), id(source))
    with _locked(path.parent):
        previous = _read_samples(path)
        families, added = _accumulate(_dream_families(source), previous, _contributed.get(owner, {}))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(families))
        _replace(path, generate_latest(registry))
    _contributed[owner] = added


def _dream_families(source: CollectorRegistry) -> list[Metric]:
    return [family for family in source.collect() if family.name.startswith(PREFIX)]


def _key(name: str, labels: dict[str, str]) -> _SampleKey:
    return name, tuple(sorted(labels.items()))


def _read_samples(path: Path) -> dict[_SampleKey, float]:
    """Every sample in the file as it stands; none if it is missing or unreadable."""
    try:
        text = path.read_text("utf-8")
        return {_key(s.name, s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    except (OSError, ValueError):
        # Not ours to repair: starting from zero again is a counter reset, which
        # Prometheus handles; refusing to write would hide every later count.
        return {}


def _accumulate(
    families: list[Metric], previous: dict[_SampleKey, float], contributed: dict[_SampleKey, float]
) -> tuple[list[Metric], dict[_SampleKey, float]]:
    """The families with the file's totals added; and what this process has now added."""
    merged: list[Metric] = []
    added: dict[_SampleKey, float] = {}
    for family in families:
        if family.type not in CUMULATIVE:
            merged.append(family)
            continue
        out = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            key = _key(sample.name, sample.labels)
            if sample.name.endswith(CREATED):
                value = previous.get(key, sample.value)
            else:
                # Only what this process counted since it last wrote here is new.
                value = previous.get(key, 0.0) + sample.value - contributed.get(key, 0.0)
                added[key] = sample.value
            out.add_sample(sample.name, sample.labels, value)
        merged.append(out)
    return merged, added


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    # A lock on the directory itself: no lock file for the collector to trip over.
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _replace(path: Path, data: bytes) -> None:
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

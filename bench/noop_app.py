"""The baseline for ``P2``: the project's own Celery app with one task that does nothing.

Built with :func:`worker.app.create_app` (the same configuration, the same hooks in
:mod:`worker.celery_hooks`), so a worker started with ``celery -A bench.noop_app
worker -Q signals -c 2`` pays every per-task cost of the real worker except the work.
"""

from __future__ import annotations

from worker.app import SIGNALS_QUEUE, create_app
from worker.settings import get_settings

NOOP_TASK = "bench.noop"

app = create_app(get_settings())


@app.task(name=NOOP_TASK, queue=SIGNALS_QUEUE)  # type: ignore[untyped-decorator]
def noop(item: int) -> None:
    """Nothing: the cost of a message through broker, worker and hooks."""

"""Beat's schedule: a handful of periodic tasks, none per user.

Per-user timing lives in ``dream_user_state``; beat only ticks the dispatcher, which
claims the users that are due. Every entry expires when the next one would fire, so a
beat that was down, or a worker backlog, never piles up stale ticks.
"""

from __future__ import annotations

from typing import Any

from celery.schedules import crontab

from worker.settings import Settings

#: Routine detection runs once a day, at a quiet hour (UTC).
ROUTINES_AT = {"hour": 3, "minute": 17}
ADOPT_EVERY_SECONDS = 3600.0
PENDING_GAUGE_EVERY_SECONDS = 15.0
ROUTINES_EVERY_SECONDS = 24 * 3600.0


def periods(settings: Settings) -> dict[str, float]:
    """Task name -> how often beat sends it, for the tasks that must run once per period
    however many beats run (see :mod:`worker.periodic`). The dispatcher is not here:
    its claims already make a second tick harmless, and the pending gauge is one cheap
    count."""
    return {
        "schedules.sweep": settings.sweep_interval_seconds,
        "schedules.adopt": ADOPT_EVERY_SECONDS,
        "activity.routines": ROUTINES_EVERY_SECONDS,
        "retention.purge": settings.purge_interval_seconds,
    }


def beat_schedule(settings: Settings, *, signals_queue: str) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` setting for ``settings``.

    The queue gauges are refreshed twice over: on the housekeeping queue (the task's
    own) and on ``signals_queue``. Each worker serves the gauges its own processes set,
    and a worker that takes only signals (as deployed) would otherwise keep the values
    it read at start: a dead signal retried and done would still count, for every
    scrape, until that worker restarts."""
    return {
        "dispatch-due-users": {
            "task": "schedules.dispatch",
            "schedule": settings.dispatch_interval_seconds,
            "options": {"expires": settings.dispatch_interval_seconds},
        },
        "sweep-stranded-signals": {
            "task": "schedules.sweep",
            "schedule": settings.sweep_interval_seconds,
            "options": {"expires": settings.sweep_interval_seconds},
        },
        "adopt-unseen-users": {
            "task": "schedules.adopt",
            "schedule": ADOPT_EVERY_SECONDS,
            "options": {"expires": ADOPT_EVERY_SECONDS},
        },
        "detect-routines": {
            "task": "activity.routines",
            "schedule": crontab(**ROUTINES_AT),
            "options": {"expires": 6 * 3600},
        },
        "purge-expired": {
            "task": "retention.purge",
            "schedule": settings.purge_interval_seconds,
            "options": {"expires": settings.purge_interval_seconds},
        },
        "refresh-pending-gauge": {
            "task": "metrics.refresh_pending",
            "schedule": PENDING_GAUGE_EVERY_SECONDS,
            "options": {"expires": PENDING_GAUGE_EVERY_SECONDS},
        },
        "refresh-pending-gauge-on-signals": {
            "task": "metrics.refresh_pending",
            "schedule": PENDING_GAUGE_EVERY_SECONDS,
            "options": {"expires": PENDING_GAUGE_EVERY_SECONDS, "queue": signals_queue},
        },
    }

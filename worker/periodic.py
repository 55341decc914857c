"""Once per period, however many beats send it: the claims of beat's periodic tasks.

One beat should run, but a second one (an overlapping rollout, a copy started by hand)
must cost nothing. The dispatcher needs no help: its claim locks users with
``FOR UPDATE SKIP LOCKED`` and moves them to their next slot, so two ticks split the
due users between them. The other periodic tasks (the sweep, adoption, the purge, the
routines) would each do their whole work twice. Each first claims its period in the
broker's Redis, the same Redis that carried the message:

- the period is the one in which beat sent the message, read from the message's expiry
  (beat sets it to the send time plus a fixed span), so a message that waited in a
  long queue still counts for the period it was sent in;
- the first message of a period runs; later ones of the same period are dropped;
- the same message delivered again (its worker died) runs again: its claim is its own.

A message without an expiry (sent by hand) always runs. If Redis cannot be asked, the
task runs: doing the work twice is harmless, skipping it is not.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, cast

from worker.logs import get_logger
from worker.settings import Settings

KEY_PREFIX = "reverie:periodic:"

log = get_logger(__name__)


def period_index(expires: Any, period_seconds: float) -> int | None:
    """The number of the period a message with this expiry was sent in (ISO string,
    aware datetime, or epoch seconds), or None when it has no expiry."""
    if expires is None or expires == "":
        return None
    if isinstance(expires, str):
        expires = datetime.fromisoformat(expires)
    stamp = expires.timestamp() if isinstance(expires, datetime) else float(expires)
    return math.floor(stamp / period_seconds)


def claim(settings: Settings, name: str, expires: Any, token: str | None, period_seconds: float) -> bool:
    """True when the message ``token`` of periodic task ``name`` should run: it is the
    first of its period, or that period's claim is already its own."""
    index = period_index(expires, period_seconds)
    if index is None or not settings.broker_url:
        return True
    import redis

    key = f"{KEY_PREFIX}{name}:{index}"
    mine = token or ""
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5)
    try:
        if client.set(key, mine, nx=True, px=math.ceil(period_seconds * 2000)):
            return True
        holder = cast(bytes | None, client.get(key))
    except (redis.RedisError, OSError) as exc:
        log.warning("periodic.claim_unavailable", task=name, error=str(exc).splitlines()[0] if str(exc) else "")
        return True
    finally:
        client.close()
    if holder is not None and holder.decode() == mine and mine:
        return True
    log.info("periodic.skipped", task=name, period=index)
    return False

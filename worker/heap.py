"""The interpreter's cyclic garbage collector, kept off what a process loaded at start.

A pass allocates many short-lived objects (rows, lines, profiles), and every so often
the collector walks all of the objects the process holds, the modules, the settings and
the loaded models included: about 60 ms each time for ``reverie run``'s 120,000. What is
loaded before the work starts lives as long as the process, so it is moved out of the
collector's reach once (``gc.freeze``): the walks then cover only what the work made.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collect what is garbage now, then keep the collector off every object alive (once
    per process, after its start-up loads; objects made later are collected as before)."""
    gc.collect()
    gc.freeze()

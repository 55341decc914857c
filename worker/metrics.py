"""Every Prometheus family Reverie exports (docs/reference.md, Metrics), defined once.

No label ever carries a user id. In the worker these live in prometheus-client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), so prefork children add up.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# A dream run takes milliseconds (nothing to do) to minutes (many model calls).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Signal lag: from enqueue to done; wake-ups make it sub-second, the sweeper minutes.
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600, 21600, 86400)

USERS_PROCESSED = Counter("dream_users_processed_total", "Users whose dream run finished.")
ENTRIES_PRUNED = Counter("dream_entries_pruned_total", "Stale memory entries archived and removed.")
CONTRADICTIONS_FOUND = Counter("dream_contradictions_found_total", "New contradictions detected.")
ENTRIES_SUMMARIZED = Counter("dream_entries_summarized_total", "Memory entries replaced by summaries.")
CYCLES_FAILED = Counter("dream_cycles_failed_total", "Dream runs that ended in failure.")
DURATION = Histogram("dream_duration_seconds", "Wall time of one user's dream run.", buckets=DURATION_BUCKETS)
PROFILES_BUILT = Counter("dream_profiles_built_total", "Profiles written for users whose memory changed.")
PROFILE_BUILD_DURATION = Histogram(
    "dream_profile_build_seconds", "Wall time of one profile refresh (a chunk or one user).", buckets=DURATION_BUCKETS
)
PROFILE_TOKENS = Histogram(
    "dream_profile_tokens", "Tokens of each profile built.", buckets=(50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000)
)
PROFILE_FAILURES = Counter(
    "dream_profile_build_failures_total",
    "Users whose profiles a dream could not build or write (the old ones stay; the next pass tries again).",
)
PROFILE_MODEL_REPLIES = Counter(
    "dream_profile_model_replies_total",
    "Model-written profiles, by what became of the model's answer.",
    ["verdict"],
)

SIGNALS_PROCESSED = Counter(
    "dream_signals_processed_total", "Signals processed, by kind and outcome.", ["kind", "outcome"]
)
SIGNAL_LAG = Histogram("dream_signal_lag_seconds", "Time from enqueue to done, by kind.", ["kind"], buckets=LAG_BUCKETS)
# Set from the database by one process at a time: the latest value wins, whichever
# child wrote it, and survives that child's exit.
SIGNALS_PENDING = Gauge(
    "dream_signals_pending", "Signals waiting to be processed, by kind.", ["kind"], multiprocess_mode="mostrecent"
)
SIGNALS_DEAD = Gauge(
    "dream_signals_dead",
    "Signals out of attempts, waiting for `reverie signals retry`, by kind.",
    ["kind"],
    multiprocess_mode="mostrecent",
)
SIGNALS_OLDEST_PENDING_AGE = Gauge(
    "dream_signals_oldest_pending_age_seconds",
    "Age of the oldest pending signal (0 when none is pending).",
    multiprocess_mode="mostrecent",
)
# The queue gauges are read on beat's schedule, through the broker: with either down
# they keep their last values. This says when they were read (0: not yet).
SIGNALS_GAUGES_READ_AT = Gauge(
    "dream_signals_gauges_read_timestamp_seconds",
    "When the queue gauges were last read from the database (Unix time; 0: not yet).",
    multiprocess_mode="mostrecent",
)
MEMORY_WRITES = Counter(
    "dream_memory_writes_total", "Writes to the memory table, by source and action.", ["source", "action"]
)
LLM_COST = Counter("dream_llm_cost_usd_total", "Settled model spend in USD.", ["model", "purpose"])
LLM_TOKENS = Counter("dream_llm_tokens_total", "Model tokens, by direction.", ["model", "direction"])
LLM_REQUESTS = Counter("dream_llm_requests_total", "Model calls, by outcome.", ["model", "outcome"])
LLM_USAGE_OVER_RESERVATION = Counter(
    "dream_llm_usage_over_reservation_total",
    "Model calls whose usage passed what was reserved for it, by direction.",
    ["model", "direction"],
)
LLM_UNRECORDED_COST = Counter(
    "dream_llm_unrecorded_cost_usd_total",
    "Cost of usage above a call's reservation, which the budgets did not record.",
    ["model"],
)
BUDGET_EXHAUSTED = Counter(
    "dream_budget_exhausted_total", "Model calls not made because a budget was spent.", ["scope"]
)

KEY_MODEL_UNAVAILABLE = Counter(
    "dream_key_model_unavailable_total",
    "Times the key-matching model could not be loaded, so the rules alone matched keys, by reason.",
    ["reason"],
)
KEY_EMBEDDINGS = Counter(
    "dream_key_embeddings_total", "Keys run through the key-matching model (cached vectors are not counted)."
)

SIGNAL_OUTCOMES = ("done", "rejected", "failed", "dead")
# Label values known in advance, exported at zero from the first scrape.
MEMORY_WRITE_SOURCES = ("session_end", "feedback", "activity", "summarize")
MEMORY_WRITE_ACTIONS = ("insert", "update", "delete")
LLM_PURPOSES = ("extract_facts", "feedback", "summarize", "profile")
PROFILE_VERDICTS = ("rewritten", "unchanged", "refused", "unusable", "not_called", "failed")
LLM_DIRECTIONS = ("input", "output")
LLM_OUTCOMES = ("ok", "transient", "permanent", "error", "over_ceiling", "malformed")
BUDGET_SCOPES = ("run", "day", "user", "signal")
KEY_MODEL_REASONS = ("missing", "checksum", "runtime", "broken")

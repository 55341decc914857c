"""The one typed settings object (every field: docs/reference.md, Settings).

Read from ``REVERIE_*`` environment variables and a ``.env`` file in the working
directory. Modules receive a :class:`Settings` instance; none reads ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite:///reverie.db"
#: Default shares of ``max_cost_per_day`` for one user's signals and for one signal.
USER_DAY_SHARE = 0.10
SIGNAL_SHARE = 0.02

#: The largest number of days and amount in USD a setting or a policy takes (a thousand
#: years; a billion, which the database's nano-USD counters hold nine times over), and
#: the longest duration (ten years) any other setting in seconds or hours takes. Larger
#: ones are refused, naming them, rather than left to overflow the date arithmetic and
#: the database's counters in every user's dream.
MAX_DAYS = 365_000
MAX_USD = 1_000_000_000.0
MAX_DURATION_SECONDS = 10 * 365 * 86_400

#: The log hash key a fresh install has: public, so anyone can hash a known user id
#: with it and find that user in the logs. Services warn at start while it is in use.
PUBLIC_LOG_HASH_KEY = "reverie"


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


#: The columns of EDDI's memory table (``store.models.memory_table``; a test holds them equal).
EDDI_MEMORY_COLUMNS = frozenset(
    {"id", "user_id", "key", "value", "category", "visibility", "source_agent_id", "group_ids"}
    | {"source_conversation_id", "conflicted", "access_count", "created_at", "updated_at"}
)


#: What ``REVERIE_LOG_LEVEL`` may be (any case): the levels a worker and beat take too.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


#: What a broker URL says in its own parts (scheme, user, password, host, port, path).
#: A host name: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
_BROKER_URL_PARTS = frozenset({"transport", "hostname", "port", "userid", "password", "virtual_host"})


class Settings(BaseSettings):
    """Every knob Reverie has. Per-agent policies override the dream defaults."""

    # No setting is infinite (a cost cap of inf, an interval of inf): each one is refused.
    model_config = SettingsConfigDict(
        env_prefix="REVERIE_", env_file=".env", env_file_encoding="utf-8", extra="ignore", allow_inf_nan=False
    )

    # -- connections --------------------------------------------------------------
    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = "redis://localhost:6379/0"
    memory_table: str = Field(default="usermemories", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    # Name of a last-access timestamp column on the host memory table, if it has one.
    memory_last_access_column: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
    # A host that vanishes mid-transaction (cut off, frozen, powered off) says nothing:
    # PostgreSQL would keep its session, and the row locks it holds (a lease, a signal),
    # until TCP gives up, hours later. The server ends a Reverie session idle this long
    # inside a transaction (0: the server's own setting)...
    # (at most PostgreSQL's own limit for it, 2^31 - 1 milliseconds)
    database_idle_in_transaction_seconds: float = Field(default=300.0, ge=0, le=2_147_483)
    # ...and each side probes a silent connection after this many seconds and drops it
    # two probes later (0: the operating system's defaults; at most Linux's limit, 32,767).
    database_keepalive_seconds: float = Field(default=10.0, ge=0, le=32_767)

    # -- the model ----------------------------------------------------------------
    llm_model: str = "offline"
    llm_input_cost_per_token: float | None = Field(default=None, ge=0)
    llm_output_cost_per_token: float | None = Field(default=None, ge=0)
    llm_max_output_tokens: int = Field(default=1024, ge=16, le=32768)
    llm_timeout_seconds: float = Field(default=60.0, gt=0)
    # An OpenAI-compatible endpoint for the model (litellm's ``api_base``), e.g. a local server.
    llm_api_base: str | None = None
    # How to ask for JSON: ``auto`` asks for a JSON schema where litellm says the model
    # supports one, else JSON mode where supported, else relies on the prompt alone.
    llm_response_format: Literal["auto", "json_schema", "json_object", "json_object_schema", "none"] = "auto"
    # Seed of the built-in model's drifting mode (``REVERIE_LLM_MODEL=offline/drift``).
    llm_drift_seed: int = 0
    # Tokens of the user's existing entries shown to the extracting model (0: none).
    known_entries_token_budget: int = Field(default=600, ge=0)
    max_cost_per_run: float = Field(default=0.50, ge=0, le=MAX_USD)
    max_cost_per_day: float = Field(default=5.00, ge=0, le=MAX_USD)
    # What one user's signals may spend in a UTC day, and one signal over all its
    # attempts; unset, a share of the day's cap, so one producer cannot spend it all.
    max_cost_per_user_per_day: float | None = Field(default=None, ge=0, le=MAX_USD)
    max_cost_per_signal: float | None = Field(default=None, ge=0, le=MAX_USD)
    # Prompt tokens reserved on top of litellm's count, as a fraction of it; unset, by
    # provider family (none where litellm counts with the provider's own tokenizer).
    llm_prompt_token_margin: float | None = Field(default=None, ge=0, le=4)

    # -- dream defaults (EDDI dreamConfig; per-agent policies override) ------------
    prune_stale_after_days: int = Field(default=90, ge=0, le=MAX_DAYS)
    detect_contradictions: bool = True
    contradiction_resolution: Literal["flag", "keep_newest"] = "flag"
    summarize_interactions: bool = True
    summarize_min_entries: int = Field(default=5, ge=2)
    summarize_target_entries: int = Field(default=2, ge=1)
    cross_agent_maintenance: bool = False
    protected_categories: str = "property,legacy"
    dream_interval_hours: float = Field(default=24.0, gt=0)
    # How long a dream run holds a user's lease between renewals; unset, the larger of
    # ten minutes and four model timeouts.
    dream_lease_seconds: float | None = Field(default=None, ge=2)
    # Tokens a profile (prompt-ready memory per user and agent) may hold.
    profile_token_budget: int = Field(default=2000, ge=1, le=1_000_000)
    # Who writes a profile: the deterministic builder, or the model (policy ``profileWriter``).
    profile_writer: Literal["deterministic", "model"] = "deterministic"
    # False: dreams build no profiles at all (the ones stored stay as they are).
    build_profiles: bool = True

    # -- signals ------------------------------------------------------------------
    allowed_categories: str = "preference,fact,context"
    # At most 256 MiB: PostgreSQL's jsonb holds no larger value.
    max_payload_bytes: int = Field(default=1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_items_per_signal: int = Field(default=2000, ge=1)
    max_writes_per_turn: int = Field(default=10, ge=0)
    min_user_messages: int = Field(default=1, ge=0)
    feedback_min_recurrence: int = Field(default=2, ge=1)
    routine_min_weeks: int = Field(default=3, ge=2)
    routine_window_minutes: int = Field(default=60, ge=1, le=720)
    habit_min_days: int = Field(default=5, ge=2, le=MAX_DAYS)
    signal_max_attempts: int = Field(default=5, ge=1, le=10_000)
    signal_lease_seconds: int = Field(default=300, ge=5)
    # Signals one wake-up claims and applies together (its own first): more drains a
    # backlog faster; a worker killed mid-batch leaves that many to their leases.
    signal_wakeup_batch: int = Field(default=40, ge=1, le=1000)
    signal_backoff_seconds: float = Field(default=30.0, ge=0)

    # -- retention, in days (0 keeps forever) -------------------------------------
    # The archive is the restore window; a finished signal keeps its row (idempotency)
    # but not its payload; runs are kept at least as long as their archive rows.
    archive_retention_days: int = Field(default=30, ge=0, le=MAX_DAYS)
    signal_payload_retention_days: int = Field(default=7, ge=0, le=MAX_DAYS)
    event_retention_days: int = Field(default=90, ge=0, le=MAX_DAYS)
    run_retention_days: int = Field(default=90, ge=0, le=MAX_DAYS)
    spend_retention_days: int = Field(default=90, ge=0, le=MAX_DAYS)
    purge_batch_size: int = Field(default=1000, ge=1, le=1_000_000)
    purge_interval_seconds: float = Field(default=3600.0, gt=0)

    # -- key matching -------------------------------------------------------------
    # ``embedding``: rules, then the local model; ``rules``: rules alone; ``off``: keys
    # match only when equal after case and separators.
    key_matching: Literal["embedding", "rules", "off"] = "embedding"
    # Cosine similarity of the phrases about two keys at or above which they are one key
    # (the rules and the contrast-word veto decide first); the strict one applies to keys
    # that share words but are about another thing (favorite_movie / favorite_book).
    key_match_threshold: float = Field(default=0.70, gt=0, le=1)
    key_match_strict_threshold: float = Field(default=0.90, gt=0, le=1)
    # The ONNX file to use instead of the one the model package installs.
    key_matching_model_path: str | None = None
    # The concept lexicon's synonyms (role = job_title, office = work); false keeps its
    # contrasts (home/work, first/last) and drops the synonyms.
    key_lexicon: bool = True
    # A lexicon file to use instead of the built-in worker/keymatch/data/lexicon.toml.
    key_lexicon_path: str | None = None

    # -- operations ---------------------------------------------------------------
    metrics_port: int = Field(default=9540, ge=1, le=65535)
    # Every interface by default, so Prometheus on another host (or container) can
    # scrape the worker; 127.0.0.1 keeps /metrics on this host only.
    metrics_addr: str = Field(default="0.0.0.0", min_length=1)  # noqa: S104 - see above
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: str = "INFO"
    # Key for the hash that stands in for user ids in logs.
    log_hash_key: str = PUBLIC_LOG_HASH_KEY

    # -- the service: Celery worker and beat ----------------------------------------
    dispatch_interval_seconds: float = Field(default=5.0, gt=0)
    # Users claimed per dispatcher tick, and users per ``dream.run_users`` message.
    dispatch_max_users: int = Field(default=10_000, ge=1)
    dispatch_chunk_size: int = Field(default=100, ge=1)
    # A user whose dispatched run has not finished by then is sent again (the message
    # was lost, or the worker died); longer than a chunk's hard time limit.
    dispatch_lease_seconds: int = Field(default=3600, ge=5)
    # A user touched by a signal is dreamed this long after the first change, so a busy
    # conversation costs one dream, not one per signal.
    dispatch_dirty_delay_seconds: float = Field(default=300.0, ge=0)
    sweep_interval_seconds: float = Field(default=30.0, gt=0)
    # A ready signal not picked up this long after it became available gets a new wake-up.
    sweep_grace_seconds: float = Field(default=60.0, ge=0)
    sweep_max_signals: int = Field(default=1000, ge=1)
    # Each worker's main process listens for PostgreSQL's notices of new signals (one
    # worker of the deployment at a time; the others retry this often to take over).
    signal_listener: bool = True
    signal_listener_retry_seconds: float = Field(default=3.0, gt=0)
    worker_concurrency: int = Field(default=2, ge=1)
    # How long one ``reverie run`` pass may dream; users it does not reach stay due.
    cron_time_limit_seconds: float = Field(default=840.0, gt=0)
    # Chunks one ``reverie run`` pass works on at once (threads; PostgreSQL only): one
    # chunk's Python work overlaps another's wait on the database.
    cron_concurrency: int = Field(default=2, ge=1, le=64)

    @field_validator(
        "llm_timeout_seconds",
        "dream_interval_hours",
        "dream_lease_seconds",
        "signal_lease_seconds",
        "signal_backoff_seconds",
        "purge_interval_seconds",
        "dispatch_interval_seconds",
        "dispatch_lease_seconds",
        "dispatch_dirty_delay_seconds",
        "sweep_interval_seconds",
        "sweep_grace_seconds",
        "signal_listener_retry_seconds",
        "cron_time_limit_seconds",
    )
    @classmethod
    def _at_most_ten_years(cls, value: float | None, info: ValidationInfo) -> float | None:
        longest = MAX_DURATION_SECONDS / (3600 if (info.field_name or "").endswith("_hours") else 1)
        if value is not None and value > longest:
            raise ValueError(f"must be at most {longest:,.0f} (ten years)")
        return value

    @field_validator("key_lexicon_path")
    @classmethod
    def _lexicon_readable(cls, path: str | None) -> str | None:
        # A broken lexicon file stops the process at start, not each signal later.
        if path:
            from worker.errors import LexiconInvalid
            from worker.keymatch.lexicon import load

            try:
                load(path)
            except LexiconInvalid as exc:
                raise ValueError(exc.reason) from exc
        return path

    @field_validator("memory_last_access_column")
    @classmethod
    def _not_a_memory_column(cls, name: str | None) -> str | None:
        # One of EDDI's own columns would be selected twice, and every dream would fail.
        if name and name.lower() in EDDI_MEMORY_COLUMNS:
            raise ValueError(f"{name!r} is one of the memory table's own columns, not a last-access column")
        return name

    @field_validator("event_retention_days")
    @classmethod
    def _events_outlast_the_archive(cls, days: int, info: ValidationInfo) -> int:
        # A restore reads the events to tell what was written since (by the application,
        # or a summary to take out): events gone before the archive rows make a restore
        # leave in what it should take out, or keep what it should put back.
        archive = info.data.get("archive_retention_days")
        if archive is None or days == 0:
            return days
        if archive == 0 or days < archive:
            kept = "forever (0)" if archive == 0 else f"{archive} days"
            raise ValueError(
                f"must be 0 (forever) or at least REVERIE_ARCHIVE_RETENTION_DAYS, which keeps archived rows {kept}: "
                "reverie restore reads the events of what it undoes"
            )
        return days

    @field_validator("log_level")
    @classmethod
    def _a_log_level(cls, level: str) -> str:
        # Celery's levels (a worker and beat are started with this one), in any case.
        level = level.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("metrics_addr")
    @classmethod
    def _an_address_to_listen_on(cls, addr: str) -> str:
        # Else a typo (a port written into it, a URL) was found only once the worker
        # was up, which then served no /metrics and said so in one log line.
        import ipaddress

        addr = addr.strip()
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            # A name whose last label is all digits is no host's (``9100``: a port; ``1.2.3``).
            if not _HOST_NAME.fullmatch(addr) or len(addr) > 253 or addr.rstrip(".").rsplit(".", 1)[-1].isdigit():
                raise ValueError(
                    "must be an address to listen on: an IP address (0.0.0.0, ::, 127.0.0.1) or a host name, "
                    "without a port (that is REVERIE_METRICS_PORT)"
                ) from None
        return addr

    @field_validator("broker_url")
    @classmethod
    def _a_redis_broker(cls, url: str) -> str:
        # Wake-ups go through Celery and the sweeper marks them in the broker's Redis:
        # another transport would fail only at the first send, after a signal is written.
        url = url.strip()
        if url and url.split("://", 1)[0].lower() not in ("redis", "rediss"):
            raise ValueError("must be a redis:// or rediss:// URL, or empty for no broker")
        # The broker's client reads these from the URL's own parts and cannot take them
        # again in its query (it fails with a TypeError at the first connection).
        from urllib.parse import parse_qsl, urlsplit

        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 (read to check it)
        except ValueError:
            raise ValueError("has a port that is not a number from 0 to 65535") from None
        number = parts.path.strip("/")
        if number and not number.isdigit():
            raise ValueError("has a path that is not a Redis database number (redis://host:6379/0)")
        taken = sorted({name for name, _ in parse_qsl(parts.query)} & _BROKER_URL_PARTS)
        if taken:
            raise ValueError(
                f"has {', '.join(taken)} in its query: "
                "give it in the URL's own part instead (the password before the host)"
            )
        return url

    @field_validator("database_url")
    @classmethod
    def _normalise_driver(cls, url: str) -> str:
        # An ``@`` in the password not written ``%40``: the host would be read from the
        # password's end (and a part of it printed in the error about that "host").
        before_path = url.split("://", 1)[-1].split("/", 1)[0]
        if before_path.count("@") > 1:
            raise ValueError("has more than one @ before its host: write an @ of the password as %40")
        # psycopg 3 is the driver; accept the bare scheme users copy from elsewhere.
        for prefix in ("postgresql://", "postgres://", "postgresql+psycopg2://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix) :]
        return url

    @property
    def protected_category_set(self) -> frozenset[str]:
        # Lower-cased: a category is protected in any case (``Property`` is ``property``).
        return frozenset(c.lower() for c in _csv(self.protected_categories))

    @property
    def allowed_category_set(self) -> frozenset[str]:
        return frozenset(_csv(self.allowed_categories))

    @property
    def user_day_cost_cap(self) -> float:
        """USD one user's signals may spend per UTC day (default: a tenth of the day's cap)."""
        if self.max_cost_per_user_per_day is not None:
            return self.max_cost_per_user_per_day
        return self.max_cost_per_day * USER_DAY_SHARE

    @property
    def signal_cost_cap(self) -> float:
        """USD one signal may spend over all its attempts (default: 2 % of the day's cap)."""
        if self.max_cost_per_signal is not None:
            return self.max_cost_per_signal
        return self.max_cost_per_day * SIGNAL_SHARE

    @property
    def dream_interval_seconds(self) -> float:
        """How long a user's scheduled dreams are apart (``dream_interval_hours``), in seconds."""
        return self.dream_interval_hours * 3600

    @property
    def dream_interval(self) -> timedelta:
        return timedelta(seconds=self.dream_interval_seconds)

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def sqlite_path(self) -> str:
        """The absolute path of the SQLite file (``:memory:`` for an in-memory database;
        a ``file:`` URI as it is, where the URL says ``uri=true``)."""
        location = self.database_url.split(":///", 1)[1] if ":///" in self.database_url else ""
        location, _, query = location.partition("?")
        if location in ("", ":memory:"):
            return ":memory:"
        if "uri=true" in query.lower().split("&"):
            return location
        return str(Path(location).resolve())


#: Variables of this prefix no setting reads but the project's own tools do: the test
#: suite's (``REVERIE_TEST_*``) and the benchmarks' (``REVERIE_BENCH_*``).
TOOL_PREFIXES = ("REVERIE_TEST_", "REVERIE_BENCH_")


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """The ``REVERIE_*`` variables of ``environ`` that no setting reads (a misspelled one
    leaves its setting at the default without a word), sorted."""
    fields = {name.upper() for name in Settings.model_fields}
    return sorted(
        name
        for name in environ
        if name.upper().startswith("REVERIE_")
        and not name.upper().startswith(TOOL_PREFIXES)
        and name.upper().removeprefix("REVERIE_") not in fields
    )


def settings_file_names() -> list[str]:
    """The names the settings file (``.env`` in the working directory, as the settings
    read it) sets; its values are not read here."""
    env_file = Settings.model_config.get("env_file")
    if not isinstance(env_file, str) or not Path(env_file).is_file():
        return []
    from dotenv import dotenv_values

    return [name for name in dotenv_values(env_file, encoding="utf-8") if name]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once. Tests build their own ``Settings``."""
    return Settings()

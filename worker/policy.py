"""Per-agent dream policy in EDDI ``dreamConfig`` field names (docs/reference.md, Per-agent policies).

A stored policy holds only the fields an operator set; the effective policy fills the
rest from the settings' defaults. An agent's policy governs the entries it owns;
unowned entries and agents without a policy use the defaults.
"""

# EDDI dreamConfig field names are kept verbatim, so Policy attributes are camelCase.
# ruff: noqa: N815

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from worker.errors import ConfigError
from worker.settings import MAX_DAYS, MAX_USD, Settings

RESOLUTIONS = ("flag", "keep_newest")
PROFILE_WRITERS = ("deterministic", "model")


@dataclass(frozen=True)
class Policy:
    """The effective dream policy for one agent (or the defaults)."""

    enabled: bool
    pruneStaleAfterDays: int
    detectContradictions: bool
    summarizeInteractions: bool
    maxCostPerRun: float
    summarizeMinEntries: int
    summarizeTargetEntries: int
    contradictionResolution: str
    crossAgentMaintenance: bool
    profileWriter: str

    @property
    def prunes(self) -> bool:
        return self.enabled and self.pruneStaleAfterDays > 0

    @property
    def detects(self) -> bool:
        return self.enabled and self.detectContradictions

    @property
    def summarizes(self) -> bool:
        return self.enabled and self.summarizeInteractions

    @property
    def writes_profiles_with_model(self) -> bool:
        return self.enabled and self.profileWriter == "model"

    def as_config(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Policy))


def defaults(settings: Settings) -> Policy:
    """The policy of unowned entries and of agents without one."""
    return Policy(
        enabled=True,
        pruneStaleAfterDays=settings.prune_stale_after_days,
        detectContradictions=settings.detect_contradictions,
        summarizeInteractions=settings.summarize_interactions,
        maxCostPerRun=settings.max_cost_per_run,
        summarizeMinEntries=settings.summarize_min_entries,
        summarizeTargetEntries=settings.summarize_target_entries,
        contradictionResolution=settings.contradiction_resolution,
        crossAgentMaintenance=settings.cross_agent_maintenance,
        profileWriter=settings.profile_writer,
    )


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
        return False
    raise ConfigError(f"{name} must be true or false, not {value!r}")


def _int(minimum: int, maximum: int | None = None) -> Callable[[str, Any], int]:
    def parse(name: str, value: Any) -> int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a whole number, not {value!r}")
        try:
            number = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError as exc:
            raise ConfigError(f"{name} must be a whole number, not {value!r}") from exc
        if number < minimum:
            raise ConfigError(f"{name} must be at least {minimum}, not {number}")
        if maximum is not None and number > maximum:
            raise ConfigError(f"{name} must be at most {maximum:,}, not {number:,}")
        return number

    return parse


def _cost(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an amount in USD, not {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be an amount in USD, not {value!r}") from exc
    if not number >= 0 or number == float("inf"):
        raise ConfigError(f"{name} must be a finite amount of at least 0, not {value!r}")
    if number > MAX_USD:
        raise ConfigError(f"{name} must be at most {MAX_USD:,.0f} USD, not {value!r}")
    return number


def _resolution(name: str, value: Any) -> str:
    if value not in RESOLUTIONS:
        raise ConfigError(f"{name} must be one of {', '.join(RESOLUTIONS)}, not {value!r}")
    return str(value)


def _writer(name: str, value: Any) -> str:
    if value not in PROFILE_WRITERS:
        raise ConfigError(f"{name} must be one of {', '.join(PROFILE_WRITERS)}, not {value!r}")
    return str(value)


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "enabled": _bool,
    "pruneStaleAfterDays": _int(0, MAX_DAYS),
    "detectContradictions": _bool,
    "summarizeInteractions": _bool,
    "maxCostPerRun": _cost,
    "summarizeMinEntries": _int(2),
    "summarizeTargetEntries": _int(1),
    "contradictionResolution": _resolution,
    "crossAgentMaintenance": _bool,
    "profileWriter": _writer,
}


def validate_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored policy's fields, parsed and checked; raises :class:`ConfigError`."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        parser = _PARSERS.get(name)
        if parser is None:
            raise ConfigError(f"unknown policy field {name!r}; known fields: {', '.join(FIELD_NAMES)}")
        out[name] = parser(name, value)
    return out


def parse_assignments(assignments: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings from the command line as a validated partial config."""
    raw: dict[str, Any] = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"expected KEY=VALUE, got {item!r}")
        text = value.strip()
        try:
            raw[name.strip()] = json.loads(text) if text[:1] in "[{" else text
        except ValueError:
            raw[name.strip()] = text
    return validate_config(raw)


def effective(settings: Settings, config: Mapping[str, Any] | None) -> Policy:
    """The defaults with a stored policy's fields applied."""
    base = defaults(settings)
    if not config:
        return base
    return replace(base, **validate_config(config))


@dataclass(frozen=True)
class PolicyBook:
    """Every agent's effective policy for one run, and the defaults."""

    default: Policy
    agents: Mapping[str, Policy]

    def for_agent(self, agent_id: str | None) -> Policy:
        if agent_id is None:
            return self.default
        return self.agents.get(agent_id, self.default)


def book(settings: Settings, configs: Mapping[str, Mapping[str, Any]]) -> PolicyBook:
    """All stored configs turned into effective policies."""
    return PolicyBook(
        defaults(settings), {agent: stored_policy(settings, agent, cfg) for agent, cfg in configs.items()}
    )


def stored_policy(settings: Settings, agent: str, config: Mapping[str, Any]) -> Policy:
    """:func:`effective` of an agent's stored config; a field it no longer takes (stored
    before a limit was set, or by hand) is refused naming the agent and how to mend it."""
    try:
        return effective(settings, config)
    except ConfigError as exc:
        raise ConfigError(
            f"the stored policy of agent {agent}: {exc} (`reverie policy set {agent} FIELD=VALUE` mends it)"
        ) from exc

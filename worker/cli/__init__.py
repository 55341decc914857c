"""``reverie``: the command line (docs/reference.md, Command line).

Start-up stays fast: each command imports what it needs when it runs. Every error a
user can cause ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

from worker.cli.common import app, fail

# Each module registers its commands on ``app``.
from worker.cli import dream_cmds, erase_cmds, health_cmds, profile_cmds, service_cmds, signal_cmds, store_cmds  # noqa: F401  isort: skip


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point.

    The command-line framework runs in its standalone mode, so usage errors, ``--help``
    and a bare ``reverie`` are presented by the framework itself, with the exit codes
    click programs use (2 for a usage error), whichever click it carries: a framework
    that vendors its own click cannot turn them into "unexpected" errors. Anything else
    that escapes a command becomes one line.
    """
    try:
        app(args=argv, prog_name="reverie")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except Exception as exc:
        from worker.cli.common import describe_error

        fail(describe_error(exc))


__all__ = ["app", "main"]

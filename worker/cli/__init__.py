"""``reverie``: the command line (contract section 4).

Start-up stays fast: each command imports what it needs when it runs. Every error a
user can cause ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import sys

import click
import typer

from worker.cli.common import app, fail

# Each module registers its commands on ``app``.
from worker.cli import dream_cmds, erase_cmds, service_cmds, signal_cmds, store_cmds  # noqa: F401  isort: skip


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        code = app(args=argv, prog_name="reverie", standalone_mode=False)
    except click.exceptions.UsageError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        fail("aborted", code=130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except Exception as exc:
        from worker.cli.common import describe_error

        fail(describe_error(exc))
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main", "typer"]

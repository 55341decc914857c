"""``python -m tests``: the whole suite, with what it needs checked first.

It makes sure the tools the suite drives for real are here (Debian's ``prometheus``
package, installed when running as root with apt), that PostgreSQL and Redis answer
(starting the local servers when their usual start commands exist), then runs pytest
with the arguments given; the long-form ``slow`` runs only with ``-m slow``, the
real-model run only with ``-m realmodel``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

SERVICES = {
    "PostgreSQL": (
        "127.0.0.1",
        5432,
        "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    ),
    "Redis": (
        "127.0.0.1",
        6379,
        'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no '
        "--dir /var/lib/redis --logfile /var/log/redis/ci.log",
    ),
}


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def ensure_services() -> None:
    for name, (host, port, start) in SERVICES.items():
        if _answers(host, port):
            continue
        binary = start.split()[0]
        if shutil.which(binary):
            print(f"{name} is not answering on {host}:{port}; starting it: {start}", flush=True)
            subprocess.run(start, shell=True, check=False)
            for _ in range(30):
                if _answers(host, port):
                    break
                time.sleep(0.5)
        if not _answers(host, port):
            sys.exit(f"{name} is required on {host}:{port} for the integration tests. Start it with: {start}")


def ensure_prometheus() -> None:
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing Debian's prometheus package (the observability tests run a real server)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"], check=True, env=env
        )
        # The package starts a system service; the tests run their own server.
        subprocess.run(["sh", "-c", "service prometheus stop || pkill -x prometheus || true"], check=False)
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        sys.exit("the observability tests need prometheus and promtool: apt-get install prometheus")


def main() -> int:
    ensure_services()
    ensure_prometheus()
    import pytest

    args = sys.argv[1:]
    # The long-form runs and the real-model run are opt-in, also when only some files are named.
    if not any(arg == "-m" or arg.startswith("-m") for arg in args):
        args = ["-m", "not slow and not realmodel", *args]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())

"""``reverie demo`` as the README runs it: embedded, offline, and it does the whole job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_the_whole_pipeline_offline(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVERIE_")}
    # No broker, no model endpoint: anything that tried the network would fail here.
    env.update({"REVERIE_BROKER_URL": "redis://127.0.0.1:1/0", "NO_PROXY": "*", "COLUMNS": "200"})
    result = subprocess.run(
        [sys.executable, "-c", "from worker.cli import main; main()", "demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert (tmp_path / "reverie-demo.db").exists()
    # Facts from user messages are accepted; what the assistant and the tool said about
    # themselves ("My name is TravelBot") never becomes a memory of the user's.
    assert "favorite_color" in out and "accepted" in out
    assert "TravelBot" not in out
    # A key said another way lands on the existing entry (archived first), not beside it.
    assert "update (proposed as 'favorite_color', same meaning)" in " ".join(out.split())
    # Malformed producer rows are rejected with the field named.
    assert "payload.conversation_id" in out and "payload.events[0].at" in out
    # The dream pass pruned, flagged and summarized, and spent something under the cap.
    summary = out[out.rindex("pass:") :].replace("\n", " ")
    assert "pruned 3" in summary and "contradictions 2" in summary and "summarized 6" in summary
    assert "routines found 1" in summary
    assert "signals done 5" in summary and "rejected 2" in summary

"""Job state files are outside input too: a damaged one is named, never a traceback, and the
other jobs are still listed (the jobs screen and `k3tui jobs` read them through list_jobs)."""

from __future__ import annotations

import json

import pytest

from k3tui.errors import K3Error
from k3tui.jobs import jobs_dir, list_jobs, read_state


def test_a_damaged_state_file_is_named_and_skipped():
    d = jobs_dir()
    d.mkdir(parents=True, exist_ok=True)
    (d / "not-a-table.json").write_text("[]")
    (d / "half.json").write_text('{"kind": "download"')
    (d / "no-start.json").write_text(json.dumps({"id": "no-start", "kind": "download",
                                                 "status": "done", "started": None}))
    (d / "ok.json").write_text(json.dumps({"id": "ok", "kind": "download", "status": "done",
                                           "started": 1}))
    assert [s["id"] for s in list_jobs()] == ["ok", "no-start"]
    for job in ("not-a-table", "half"):
        with pytest.raises(K3Error, match="damaged"):
            read_state(job)

"""Reading ``lossscale-callbacks report --json`` back in tests (one shape for one run or many)."""

from __future__ import annotations

import json


def the_read_run(out: str) -> dict:
    """The one run of a ``--json`` output that was read (every run found is listed, read or not)."""
    payload = json.loads(out)
    (run,) = [r for r in payload["runs"] if r["status"] == "read"]
    return {**run, "png": payload["png"]}

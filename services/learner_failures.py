"""Which groups the learner died on, kept in the run folder so a resumed run does not die on them
again and again.

A batch that kills the learner's process (a device-side assert, an out-of-memory) stops the run,
and `etarl train --resume` restores the buffer from the last checkpoint, which predates the
crash: the buffer's own count of failed deliveries (`buffer.max_deliveries`) is gone, and the
same batch would be pulled and crash the learner on every resume. So the controller marks the
groups of the batch it hands the learner (`RUN_DIR/learner-training.json`, removed when the step
returns); a marker still there at the next start means the process died on that batch, and each
of its groups counts one failure in `RUN_DIR/learner-failures.json`. The counts go into the
restored buffer, which drops a group as poisoned once it reaches `max_deliveries` (its ticket is
reissued: the prompt is generated again, nothing is lost). Both files are a few KB (B group ids).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
MARKER_FILE = "learner-training.json"
COUNTS_FILE = "learner-failures.json"


def _write_json(path: Path, value) -> None:
    """Written whole or not at all (a kill mid-write leaves the old file): temp file + rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class LearnerFailures:
    def __init__(self, run_dir: str | os.PathLike):
        self.marker = Path(run_dir) / MARKER_FILE
        self.counts_path = Path(run_dir) / COUNTS_FILE
        self.counts: dict[str, int] = json.loads(self.counts_path.read_text()) if self.counts_path.exists() else {}

    def recover(self) -> list[str]:
        """At start: the groups of a batch the last process died on (each counted once more), or []."""
        if not self.marker.exists():
            return []
        try:
            groups = json.loads(self.marker.read_text())["groups"]
        except (ValueError, KeyError, TypeError):  # cannot happen through _write_json; a hand-edited file
            log.warning("ignoring an unreadable %s", self.marker)
            groups = []
        for group_id in groups:
            self.counts[group_id] = self.counts.get(group_id, 0) + 1
        _write_json(self.counts_path, self.counts)
        self.marker.unlink()
        if groups:
            log.error("the last run died while the learner trained on groups %s: each counts a failed delivery "
                      "(dropped as poisoned at buffer.max_deliveries)", groups)
        return groups

    def training(self, group_ids: list[str]) -> None:
        """The learner is about to train on these groups."""
        _write_json(self.marker, {"groups": list(group_ids)})

    def trained(self) -> None:
        """The step returned (trained, or refused and handed back: the buffer counted that)."""
        self.marker.unlink(missing_ok=True)

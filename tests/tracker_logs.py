"""What a run's trackers wrote, read back: TensorBoard's scalars and W&B's offline runs (what W&B would
upload: its server cannot be reached from here)."""
from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.trackers import TENSORBOARD_DIR

LOG_BLOCK = 32 * 1024  # a .wandb file is a LevelDB-style log: 32 KiB blocks of framed records
FULL, LAST = 1, 4


def wandb_records(path):
    """The protobuf records of a .wandb file (its 7-byte header, then records framed as LevelDB logs are:
    checksum, length, type; a record split over blocks comes in FIRST/MIDDLE/LAST pieces)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pieces, at = [], b"", 7
    while at + 7 <= len(data):
        if LOG_BLOCK - at % LOG_BLOCK < 7:  # a block's tail too short for a header is padding
            at += LOG_BLOCK - at % LOG_BLOCK
            continue
        length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
        pieces += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_runs(run_dir):
    """[(run id, project, [history rows])] of the W&B runs written under run_dir, oldest first."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        records = wandb_records(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        rows = [{key: json.loads(item.value_json) for item in r.history.item
                 for key in [item.key or "/".join(item.nested_key)] if not key.startswith("_")}
                for r in records if r.WhichOneof("record_type") == "history"]
        runs.append((run.run_id, run.project, rows))
    return runs


def tensorboard_scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    return [(event.step, round(event.value, 6)) for event in events.Scalars(tag)]

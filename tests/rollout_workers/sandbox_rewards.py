"""Rewards that probe the reward process's box (imported by name in the reward child process; no
torch here, so the child starts fast and small). Each behaves when the response is "fine"."""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path


class OpensAFile:
    """A pickle-only object: unpickling it calls open(path, "w"), i.e. runs code in the reader."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def environment_names(response: str, answer: str) -> float:
    """Writes the names of the variables this process sees to the file `answer`."""
    Path(answer).write_text(json.dumps(sorted(os.environ)))
    return 1.0


def burn_cpu(response: str, answer: str) -> float:
    if response == "burn":
        while True:
            pass
    return float(len(response))


def allocate(response: str, answer: str) -> float:
    """Allocates `answer` MB when asked to (touching nothing: only the address space limit stops it)."""
    if response == "allocate":
        block = bytearray(int(answer) * 2**20)
        return float(len(block) > 0)
    return float(len(response))


def returns_a_pickle_only_object(response: str, answer: str):
    return OpensAFile(answer) if response == "pickle" else float(len(response))


def smuggles_a_pickle(response: str, answer: str) -> float:
    """Writes a pickle straight into the reply pipe (the child is user code: it can), then answers."""
    from multiprocessing.connection import Connection

    if response == "pickle":
        for obj in gc.get_objects():
            if isinstance(obj, Connection) and obj.writable and not obj.readable:
                obj.send(OpensAFile(answer))
    return float(len(response))


def burn_cpu_batch(data_sources, solution_strs, ground_truths, extra_infos):
    """verl's batch form: burns CPU when a response says "burn", else the responses' lengths."""
    if "burn" in solution_strs:
        while True:
            pass
    return [float(len(s)) for s in solution_strs]

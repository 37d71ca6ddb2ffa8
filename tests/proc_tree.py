"""Linux process-tree probes for tests that check no process outlives its parent (via /proc)."""

from __future__ import annotations

import os


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children, over all its threads."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(p) for p in f.read().split()]
    return kids


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (the state field follows the command's ')')."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_running(pid: int, marker: bytes) -> list[int]:
    """``pid``'s children whose command line holds ``marker``."""
    found = []
    for kid in children_of(pid):
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if marker in f.read():
                found.append(kid)
    return found

"""Summarize py-spy ``--format raw`` (collapsed stacks) files: samples per thread, the frames
that cost the most on their own (self) and with their callees (inclusive).

    python3 bench/pyspy_summary.py pyspy_worker0_c64k0.txt [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")


def summarize(path: Path, top: int, thread: str = "") -> str:
    """``thread``: only stacks whose thread label contains it (e.g. the engine thread's name)."""
    threads, selfs, incl = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        label = frames[0]
        if thread and thread not in label:
            continue
        names = []
        for f in frames[1:]:
            m = _FRAME.match(f)
            names.append(f"{m.group(1)} ({m.group(2)})" if m else f)
        total += n
        threads[label] += n
        if names:
            selfs[names[-1]] += n
        for name in set(names):
            incl[name] += n
    out = [f"== {path.name}{f' (threads matching {thread!r})' if thread else ''}: {total} samples"]
    out += [f"  thread {t}: {c} ({100 * c / total:.0f} %)" for t, c in threads.most_common(6)]
    out.append("  self:")
    out += [f"    {100 * c / total:5.1f} %  {name}" for name, c in selfs.most_common(top)]
    out.append("  inclusive:")
    out += [f"    {100 * c / total:5.1f} %  {name}" for name, c in incl.most_common(top * 2)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--thread", default="", help="only threads whose label contains this")
    args = p.parse_args()
    for f in args.files:
        print(summarize(f, args.top, args.thread))


if __name__ == "__main__":
    main()

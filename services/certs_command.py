"""``tandem certs``: write a throwaway CA and one certificate per service into a folder (what
compose's one-shot ``certs`` step runs; ``tandem up`` does the same in memory of its run).

    tandem certs --out /certs --workers 1 --hosts kvstore,router,worker-0

Files: ``ca.crt``, ``kvstore-kvstore.crt/.key``, ``router-router.crt/.key``,
``worker-worker<i>.crt/.key`` (keys mode 0600). An existing ``ca.crt`` is kept as is and nothing
is rewritten unless ``--force``, so restarting the step does not invalidate running services.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.certs import DEFAULT_HOSTS, LocalCA


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for the CA and the certificates")
    parser.add_argument("--workers", type=int, default=1, help="worker certificates worker0..worker<N-1> (default 1)")
    parser.add_argument("--hosts", default="", help="comma-separated extra host names the services are dialled by")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "ca.crt").exists() and not args.force:
        print(f"tandem certs: {out / 'ca.crt'} exists; keeping the certificates (--force replaces them)")
        return 0
    if args.workers < 0 or args.days < 1:
        print("tandem certs: error: --workers must be >= 0 and --days >= 1", file=sys.stderr)
        return 2
    if args.force:
        (out / "ca.crt").unlink(missing_ok=True)
    hosts = (*DEFAULT_HOSTS, *(h.strip() for h in args.hosts.split(",") if h.strip()))
    ca = LocalCA(days=args.days)
    identities = [("kvstore", "kvstore"), ("router", "router"), *(("worker", f"worker{i}") for i in range(args.workers))]
    for role, ident in identities:
        ca.write(out, role, ident, hosts)
    print(f"tandem certs: CA and {len(identities)} certificates in {out}")
    return 0

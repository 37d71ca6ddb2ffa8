#!/usr/bin/env python3
"""Regenerate the Python gRPC code under ``tandem/`` from ``protos/`` (the one command).

    python scripts/gen_protos.py            # write tandem/**/*_pb2*.py(i)
    python scripts/gen_protos.py --out DIR  # write elsewhere (the staleness test compares)

Proto paths mirror Python packages (``protos/tandem/kvstore/v1/kvstore.proto`` →
``tandem.kvstore.v1.kvstore_pb2``), so generated imports work without patching.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE_DOC = '"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n'


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools) over every proto into ``out``; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTOS)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written: list[Path] = []
    for rel in files:
        pkg_dir = out / Path(rel).parent
        # every directory from tandem/ down to the proto's folder is a package
        d = pkg_dir
        while d != out:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text(PACKAGE_DOC)
            d = d.parent
        stem = Path(rel).stem
        written += [pkg_dir / f"{stem}_pb2.py", pkg_dir / f"{stem}_pb2.pyi", pkg_dir / f"{stem}_pb2_grpc.py"]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path.relative_to(ns.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``tandem`` command: one subcommand per service or tool.

Each subcommand lives in its own module, imported only when chosen (so ``tandem kvstore`` never
imports torch). A module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import PackageNotFoundError, version

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "kvstore": ("services.kvstore.main", "run the kvstore gRPC service"),
    "router": ("services.router.main", "run the router gRPC service"),
    "worker": ("services.gpuworker.main", "run a gpuworker (model + KV pools + engine)"),
    "distill-draft": ("services.gpuworker.distill", "train a model's draft layers on its own greedy outputs"),
    "train-demo": ("services.gpuworker.train_demo", "train the demo model (byte-level Llama) on the Python standard library"),
    "up": ("services.launcher", "run kvstore + router + workers locally and wait"),
    "generate": ("services.client", "stream an answer from the router"),
    "certs": ("services.certs_command", "write a throwaway CA and service certificates for mTLS (compose)"),
}


def tandem_version() -> str:
    try:
        return version("tandem-serve")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def _global_flags(default) -> argparse.ArgumentParser:
    """Flags accepted before AND after the subcommand. Subparsers get ``SUPPRESS`` defaults, so a
    flag given before the subcommand is not overwritten by the subparser's default."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default=default, type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default INFO)")
    parent.add_argument("--version", action="version", version=f"tandem {tandem_version()}")
    return parent


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (all are listed in the help)."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0], parents=[_global_flags("INFO")])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    anywhere = _global_flags(argparse.SUPPRESS)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[anywhere])
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (skipping top-level options and their values)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Settings: pydantic models filled from ``TANDEM_<SERVICE>_*`` environment variables, overridden
by command-line flags, validated at start with messages a person can act on.

Each service declares a ``BaseSettings`` subclass with an ``env_prefix``; :func:`load_settings`
turns its fields into ``--flag`` options (``lease_ttl_s`` → ``--lease-ttl-s``), so flags, env vars
and defaults stay one list.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per field of ``cls`` (default: unset, so env/defaults apply)."""
    prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "") + f" [env {prefix}{name.upper()}; default {field.default!r}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """Build ``cls`` from env vars, with flags given on the command line taking precedence.

    Raises SystemExit(2) with one line per invalid field, never a traceback.
    """
    overrides = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        lines = [f"invalid {cls.__name__} configuration:"]
        prefix = cls.model_config.get("env_prefix", "")
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "?"
            lines.append(f"  --{field.replace('_', '-')} / {prefix}{field.upper()}: {err['msg']} (got {err.get('input')!r})")
        print("\n".join(lines), file=sys.stderr)
        raise SystemExit(2) from None


def service_command(
    cls: type[S], serve: Callable[[S], Awaitable[None]]
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """The ``(add_arguments, run)`` pair a ``tandem <service>`` subcommand module exports: flags
    from ``cls``'s fields, then ``serve(settings)`` on a fresh event loop until it returns."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_settings_flags(parser, cls)

    def run(args: argparse.Namespace) -> int:
        asyncio.run(serve(settings_from_args(cls, args)))
        return 0

    return add_arguments, run

"""Settings: pydantic models filled from ``TANDEM_<SERVICE>_*`` environment variables, overridden
by command-line flags, validated at start with one line per mistake a person can act on.

Each service declares a :class:`TandemSettings` subclass with an ``env_prefix``;
:func:`add_settings_flags` turns its fields into ``--flag`` options (``lease_ttl_s`` →
``--lease-ttl-s``; ``Literal`` fields list their choices), so flags, env vars and defaults stay one
list. :func:`settings_from_args` also looks at the environment as a whole: a ``TANDEM_*`` variable
no service reads is named in a warning (with the closest real name), and a Kubernetes service
link (``TANDEM_KVSTORE_PORT=tcp://10.0.0.7:50051``, injected for a Service called
``tandem-kvstore``) is an error with the fix, not a confusing "not an integer".
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal, TypeVar, get_args, get_origin

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.errors import TandemError
from services.common.startup import EXIT_CONFIG, EXIT_ENVIRONMENT, StartupError

log = logging.getLogger(__name__)

S = TypeVar("S", bound=BaseSettings)

# Modules whose settings classes define the TANDEM_* names services read (imported only to list
# names: pydantic models, no torch).
SETTINGS_MODULES = ("services.kvstore.settings", "services.router.settings", "services.gpuworker.settings", "services.launcher")
# TANDEM_* names read outside the settings classes (CLI, scripts, compose).
OTHER_ENV_NAMES = frozenset({
    "TANDEM_HOME", "TANDEM_TOKEN", "TANDEM_ROUTER_ADDRESS",
    "TANDEM_VENV", "TANDEM_PYTHON", "TANDEM_PY", "TANDEM_TORCH", "TANDEM_TORCH_INDEX",
    "TANDEM_MODEL", "TANDEM_BASE_IMAGE", "TANDEM_IMAGE", "TANDEM_GPU_IMAGE", "TANDEM_REDIS_IMAGE",
    "TANDEM_PROMETHEUS_IMAGE", "TANDEM_ROUTER_PUBLISH", "TANDEM_ROUTER_HTTP_PUBLISH", "TANDEM_PROMETHEUS_PUBLISH",  # compose.yaml
    "TANDEM_CHECK_GRAPH_INPUTS",  # debugging: ForwardGraphs range-checks inputs before replays
    "TANDEM_SMOKE_BASE", "TANDEM_SMOKE_FRESH", "TANDEM_CONTRACT_ROUTER", "TANDEM_CONTRACT_PROMETHEUS", "TANDEM_CONTRACT_HTTP",  # smoke test
})
# What Kubernetes injects for a Service named e.g. "tandem-kvstore" (docker links too).
SERVICE_LINK = re.compile(r"^TANDEM_[A-Z0-9_]+?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$")
SERVICE_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://")
# Fields whose values are never printed (bearer tokens, salt secrets): errors show "***".
SECRET_FIELD = re.compile(r"(^|_)(secret|token|tenants|password)($|_)")


def shown_value(field: str, value: object) -> str:
    """``value`` of setting ``field`` as an error message may show it: masked if secret (pure)."""
    return "'***'" if SECRET_FIELD.search(field) else repr(value)


class TandemSettings(BaseSettings):
    """Base of the three servers' settings: what every server binds, drains and serves metrics on.
    Subclasses set ``env_prefix`` and may override the defaults (each service its own port)."""

    model_config = SettingsConfigDict(extra="forbid", protected_namespaces=())

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(0, ge=0, le=65535, description="port to bind (0 = any free port)")
    max_receive_bytes: int = Field(16 << 20, ge=1024, description="largest request message in bytes")
    grace_s: float = Field(5.0, ge=0, description="seconds in-flight RPCs get on shutdown")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics, /health, /ready port on host (unset = off, 0 = any free port)"
    )
    # mTLS inside the suite: this service's certificate (it names the role and id, see
    # services/common/certs.py) is both its server certificate and its client certificate.
    tls_cert: str = Field("", description="PEM certificate of this service (mTLS on every hop; with tls_key and tls_ca; '' = insecure: every caller is trusted)")
    tls_key: str = Field("", description="PEM private key of tls_cert")
    tls_ca: str = Field("", description="PEM CA that signed every Tandem service certificate (verifies peers both ways)")
    gc_freeze: bool = Field(True, description="once started (a worker: warmed up), move every object start-up made out of the garbage collector's reach, so that a full collection does not stall the service for the whole start-up heap (services/common/gc_tuning.py). Off: CPython's collector as it starts")
    gc_warn_ms: float = Field(50.0, ge=0, description="log a warning for every garbage collection that stalls this service longer than this (ms; 0 = never)")

    @model_validator(mode="after")
    def _tls_together(self):
        if len({bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)}) > 1:
            raise ValueError("tls_cert, tls_key and tls_ca go together (all three for mTLS, none for insecure)")
        return self

    @property
    def mtls(self) -> bool:
        """Whether this service runs with mutual TLS (read-only)."""
        return bool(self.tls_cert)


def _choices(annotation) -> tuple | None:
    """The values of a ``Literal[...]`` field (also inside ``Literal[...] | None``), else None."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    literals = [a for a in get_args(annotation) if get_origin(a) is Literal]
    return get_args(literals[0]) if len(literals) == 1 else None


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per field of ``cls`` (default: unset, so env/defaults apply)."""
    prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "") + f" [env {prefix}{name.upper()}; default {field.default!r}]"
        if field.annotation is bool or field.annotation == (bool | None):  # --x / --no-x (unset: the default)
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            choices = _choices(field.annotation)
            parser.add_argument(flag, dest=name, default=None, choices=choices, help=help_text,
                                metavar="{" + ",".join(map(str, choices)) + "}" if choices else None)


def known_env_names() -> set[str]:
    """Every ``TANDEM_*`` variable some part of Tandem reads."""
    names = set(OTHER_ENV_NAMES)
    for module_name in SETTINGS_MODULES:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseSettings) and value.model_config.get("env_prefix"):
                prefix = value.model_config["env_prefix"]
                names.update(prefix + field.upper() for field in value.model_fields)
    return names


def unknown_env_names(environ: Mapping[str, str], known: set[str]) -> list[str]:
    """``TANDEM_*`` names in ``environ`` that nothing reads (service-link variables excepted)."""
    return sorted(
        name for name in environ
        if name.startswith("TANDEM_") and name not in known and not SERVICE_LINK.match(name)
    )


def check_environment(cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> None:
    """Warn about unknown ``TANDEM_*`` variables; raise :class:`StartupError` (config) for a
    service-link value in one of ``cls``'s own variables."""
    environ = os.environ if environ is None else environ
    prefix = cls.model_config.get("env_prefix", "")
    for field in cls.model_fields:
        name = prefix + field.upper()
        value = environ.get(name, "")
        if SERVICE_LINK_VALUE.match(value):
            raise StartupError(
                f"{name}={value!r} looks like a Kubernetes service link (a Service named "
                f"{name[: -len(field) - 1].lower().replace('_', '-')} injects it), not a setting: set "
                f"enableServiceLinks: false in the pod spec, rename the Service, or set {name} explicitly",
                EXIT_CONFIG,
            )
    known = known_env_names()
    for name in unknown_env_names(environ, known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        log.warning("ignoring unknown environment variable %s%s", name, hint)


def settings_from_args(cls: type[S], args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> S:
    """Build ``cls`` from env vars, with flags given on the command line taking precedence.

    Raises :class:`StartupError` (``EXIT_CONFIG``) naming the first invalid field in one line.
    """
    check_environment(cls, environ)
    overrides = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise invalid_configuration(cls, exc) from None


def invalid_configuration(cls: type[BaseSettings], exc: ValidationError,
                          built: type[BaseSettings] | None = None) -> StartupError:
    """The one-line ``StartupError`` (``EXIT_CONFIG``) for settings ``cls`` refused with ``exc``:
    each problem names its flag and environment variable (as ``cls`` spells them). Also for
    settings ``built`` that a command builds for another one (``tandem up`` checks its workers'
    settings): a field of ``built`` that ``cls`` lacks has no flag of this command, only the
    environment variable ``built`` read it from (the children inherit the environment)."""
    prefix = cls.model_config.get("env_prefix", "")
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if field and built is not None and field not in cls.model_fields:
            where = f"{built.model_config.get('env_prefix', '')}{field.upper()} (environment): "
        else:
            where = f"--{field.replace('_', '-')} / {prefix}{field.upper()}: " if field else ""
        got = f" (got {shown_value(field, err.get('input'))})" if field else ""
        problems.append(f"{where}{msg}{got}")
    return StartupError("invalid configuration: " + "; ".join(problems), EXIT_CONFIG)


def report_startup_error(command: str, exc: StartupError | TandemError) -> int:
    """Print the one line for ``exc`` and return the exit code."""
    print(f"tandem {command}: error: {exc.message}", file=sys.stderr)
    return exc.exit_code if isinstance(exc, StartupError) else EXIT_ENVIRONMENT


def service_command(
    cls: type[S], serve: Callable[[S], Awaitable[None]]
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """The ``(add_arguments, run)`` pair a ``tandem <service>`` subcommand module exports: flags
    from ``cls``'s fields, then ``serve(settings)`` on a fresh event loop until it returns.
    Start-up mistakes end in one line and their exit code (see ``services.common.startup``)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_settings_flags(parser, cls)

    def run(args: argparse.Namespace) -> int:
        command = getattr(args, "command", None) or cls.__name__
        try:
            asyncio.run(serve(settings_from_args(cls, args)))
        except (StartupError, TandemError) as exc:
            return report_startup_error(command, exc)
        except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed (start-up)
            return 130
        return 0

    return add_arguments, run

"""Layering rules, checked on the source: every import statement of every module under
``services/`` is parsed (``ast``), so a rule holds by construction rather than by discipline.

* ``services.common`` imports no service package;
* a service package (``services.kvstore``, ``services.router``, ``services.gpuworker``) imports no
  other service package — services talk over gRPC (``tandem.*`` generated code), never by import;
* the kvstore core (everything but ``servicer``, ``server``, ``metrics``, ``settings``, ``main``)
  imports neither gRPC nor the generated protocol code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
SERVICE_PACKAGES = sorted(p.name for p in SERVICES.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "common")
KVSTORE_ADAPTERS = {"servicer", "server", "metrics", "settings", "main"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (relative ones resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module in ("services", "services.common"):  # `from services import kvstore`
                out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, module))
    return out


def owner(module: str) -> str | None:
    """The ``services`` package a module belongs to (``common``, ``kvstore``, ...), or None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def violations() -> list[str]:
    out = []
    for path in sorted(SERVICES.rglob("*.py")):
        rel = path.relative_to(SERVICES)
        mine = rel.parts[0] if len(rel.parts) > 1 else None  # None: services/*.py (entry points)
        if mine is None:
            continue
        for line, module in imported_modules(path):
            theirs = owner(module)
            where = f"services/{rel}:{line} imports {module}"
            if mine == "common" and theirs in SERVICE_PACKAGES:
                out.append(f"{where}: common must not import a service")
            elif mine in SERVICE_PACKAGES and theirs in SERVICE_PACKAGES and theirs != mine:
                out.append(f"{where}: a service must not import another service")
            if mine == "kvstore" and path.stem not in KVSTORE_ADAPTERS and (
                module.split(".")[0] in ("grpc", "tandem") or module.startswith("services.common.server")
            ):
                out.append(f"{where}: the kvstore core must not depend on gRPC")
    return out


def test_services_import_only_common_and_common_imports_no_service():
    assert SERVICE_PACKAGES == ["gpuworker", "kvstore", "router"]
    assert violations() == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("common/x.py", "from services.router import dispatcher\n"),
        ("router/x.py", "import services.kvstore.store\n"),
        ("gpuworker/x.py", "from services.kvstore.types import WorkerSpec\n"),
        ("kvstore/store.py", "import grpc\n"),
        ("kvstore/x.py", "from ..router import retry\n"),
        ("router/x.py", "from services import gpuworker\n"),
    ],
)
def test_the_checker_catches_each_kind_of_violation(tmp_path, monkeypatch, source, expected):
    """The rules above are live: a planted bad import of each kind is reported."""
    fake = tmp_path / "services"
    for pkg in ("common", *SERVICE_PACKAGES):
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / source).write_text(expected)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "SERVICES", fake)
    found = violations()
    assert len(found) == 1 and found[0].startswith(f"services/{source}:1 imports"), found

"""Fixtures of the router tests; the rig itself lives in ``router_rig``."""

from __future__ import annotations

import pytest

from router_rig import Rig


@pytest.fixture
def rig(start_kvstore_service, start_service, service_loop) -> Rig:
    """A fresh kvstore (long leases) and handles to start workers and routers against it."""
    kv = start_kvstore_service(lease_ttl_s=120.0)
    return Rig(kv=kv, start_service=start_service, service_loop=service_loop)

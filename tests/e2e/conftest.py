"""Fixtures of the end-to-end tests; the rig itself lives in ``suite_rig``."""

from __future__ import annotations

import pytest

from suite_rig import Suite


@pytest.fixture
def suite(start_kvstore_service, start_service) -> Suite:
    """A kvstore with short leases; add workers and a router with ``add_worker`` / ``add_router``."""
    kv = start_kvstore_service(lease_ttl_s=1.5)
    return Suite(kv=kv, start_service=start_service)

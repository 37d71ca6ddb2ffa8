"""Clients given several kvstore addresses (a leader and its standbys) get one gRPC target that
pick_first walks in order; a single address stays as it is."""

from __future__ import annotations

import pytest

from services.common.channels import grpc_target
from services.common.errors import InvalidArgument


def test_one_address_is_kept_and_a_list_becomes_a_resolved_ipv4_target():
    assert grpc_target("kvstore:50051") == "kvstore:50051"
    assert grpc_target("127.0.0.1:1, localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"  # one family
    assert grpc_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    assert grpc_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"


@pytest.mark.parametrize("bad", ["127.0.0.1:1,", "127.0.0.1:1,nohost", "127.0.0.1:1,host:port", "a:1,no-such-host.invalid:2"])
def test_a_bad_entry_is_a_clear_error(bad):
    with pytest.raises(InvalidArgument):
        grpc_target(bad)

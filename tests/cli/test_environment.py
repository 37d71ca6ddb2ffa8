"""The environment as a whole: unknown TANDEM_* variables are named (with the closest real one);
Kubernetes service-link variables are recognised, never mistaken for settings."""

from __future__ import annotations

import logging

import pytest

from services.common.settings import check_environment, known_env_names, unknown_env_names
from services.common.startup import EXIT_CONFIG, StartupError
from services.kvstore.settings import KVStoreSettings
from services.router.settings import RouterSettings


def test_unknown_variable_is_named_with_a_suggestion(caplog):
    with caplog.at_level(logging.WARNING):
        check_environment(RouterSettings, {"TANDEM_ROUTER_POLICY_ALPA": "2", "TANDEM_ROUTER_POLICY_ALPHA": "1", "HOME": "/"})
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring unknown environment variable TANDEM_ROUTER_POLICY_ALPA (did you mean TANDEM_ROUTER_POLICY_ALPHA?)"
    ]


def test_every_service_setting_and_launcher_setting_is_known():
    known = known_env_names()
    assert {"TANDEM_KVSTORE_LEASE_TTL_S", "TANDEM_WORKER_KV_MEMORY_FRACTION", "TANDEM_ROUTER_MAX_QUEUED",
            "TANDEM_UP_WORKERS", "TANDEM_HOME", "TANDEM_TOKEN"} <= known


def test_service_link_variables_are_not_reported_as_unknown():
    env = {
        "TANDEM_KVSTORE_SERVICE_HOST": "10.96.0.7", "TANDEM_KVSTORE_SERVICE_PORT": "50051",
        "TANDEM_KVSTORE_PORT_50051_TCP": "tcp://10.96.0.7:50051", "TANDEM_KVSTORE_PORT_50051_TCP_ADDR": "10.96.0.7",
        "TANDEM_WORKR_HOST": "x",
    }
    assert unknown_env_names(env, known_env_names()) == ["TANDEM_WORKR_HOST"]


@pytest.mark.parametrize("cls,name", [(KVStoreSettings, "TANDEM_KVSTORE_PORT"), (RouterSettings, "TANDEM_ROUTER_PORT")])
def test_service_link_in_a_port_setting_is_a_configuration_error(cls, name):
    with pytest.raises(StartupError) as info:
        check_environment(cls, {name: "tcp://10.96.0.7:50051"})
    assert info.value.exit_code == EXIT_CONFIG and "Kubernetes service link" in info.value.message


def test_another_services_link_is_none_of_this_services_business():
    check_environment(RouterSettings, {"TANDEM_KVSTORE_PORT": "tcp://10.96.0.7:50051"})  # no error

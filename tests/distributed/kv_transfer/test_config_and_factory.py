"""KVTransferConfig validation, the --kv-transfer-config flag and KVConnectorFactory."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config import KVTransferConfig
from kvserve.distributed.kv_transfer import KVConnectorBase_V1, KVConnectorFactory
from tests.distributed.kv_transfer.helpers import TEST_CONNECTORS


def test_defaults_and_role_aliases() -> None:
    config = KVTransferConfig(kv_connector="SharedStorageConnector")
    assert config.kv_role == "kv_both" and config.kv_load_failure_policy == "recompute"
    assert config.is_kv_producer and config.is_kv_consumer
    assert config.engine_id  # a random id when unset
    assert KVTransferConfig(kv_connector="X", kv_role="producer").kv_role == "kv_producer"
    consumer = KVTransferConfig(kv_connector="X", kv_role="kv_consumer")
    assert consumer.is_kv_consumer and not consumer.is_kv_producer
    assert not KVTransferConfig().is_kv_transfer_instance


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_role": "sender"}, "kv_role must be one of"),
        ({"kv_load_failure_policy": "ignore"}, "kv_load_failure_policy must be"),
        ({"kv_connector": ""}, "kv_connector must be a non-empty string"),
        ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config must be a dict"),
    ],
)
def test_invalid_fields_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**{"kv_connector": "X", **fields})  # type: ignore[arg-type]


def test_from_cli_json() -> None:
    text = json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_consumer",
            "engine_id": "e1",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"},
            "kv_load_failure_policy": "fail",
        }
    )
    config = KVTransferConfig.from_cli(text)
    assert config.engine_id == "e1" and config.kv_load_failure_policy == "fail"
    assert config.get_from_extra_config("shared_storage_path", None) == "/tmp/x"
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_cli("{kv_connector:")
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferConfig.from_cli('{"kv_conector": "X"}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVTransferConfig.from_cli("[1]")


def test_engine_args_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--kv-transfer-config", '{"kv_connector": "MultiConnector", "kv_role": "both"}']
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.kv_transfer_config is not None
    assert config.kv_transfer_config.kv_connector == "MultiConnector"
    assert config.kv_transfer_config.kv_role == "kv_both"
    assert EngineArgs().create_engine_config().kv_transfer_config is None


def test_factory_resolves_registered_and_user_connectors() -> None:
    assert {"SharedStorageConnector", "MultiConnector"} <= set(
        KVConnectorFactory.registered_names()
    )
    shared = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="SharedStorageConnector")
    )
    assert shared.__name__ == "SharedStorageConnector"
    user = KVConnectorFactory.get_connector_class(
        KVTransferConfig(
            kv_connector="AsyncLoadingConnector", kv_connector_module_path=TEST_CONNECTORS
        )
    )
    assert issubclass(user, KVConnectorBase_V1) and user.__module__ == TEST_CONNECTORS
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("MultiConnector", "x", "y")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_connector": "NoSuchConnector"}, "unknown KV connector 'NoSuchConnector'"),
        (
            {"kv_connector": "X", "kv_connector_module_path": "tests.no_such_module"},
            "cannot import module",
        ),
        (
            {"kv_connector": "Missing", "kv_connector_module_path": TEST_CONNECTORS},
            "has no KV connector class 'Missing'",
        ),
        (
            {"kv_connector": "NotAConnector", "kv_connector_module_path": TEST_CONNECTORS},
            "is not a KVConnectorBase_V1 subclass",
        ),
    ],
)
def test_factory_errors_name_the_problem(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVConnectorFactory.get_connector_class(KVTransferConfig(**fields))


@pytest.mark.parametrize(
    ("connector", "parallel", "message"),
    [
        ("P2pZmqConnector", {"tensor_parallel_size": 3}, None),
        ("P2pZmqConnector", {"pipeline_parallel_size": 2}, "does not support pipeline_para"),
        ("MultiConnector", {"tensor_parallel_size": 3}, "does not support tensor_para"),
        ("SharedStorageConnector", {"pipeline_parallel_size": 2}, None),
        ("SharedStorageConnector", {"tensor_parallel_size": 3}, None),
        (
            "SharedStorageConnector",
            {"tensor_parallel_size": 3, "pipeline_parallel_size": 2},
            None,
        ),
        ("TieredCacheConnector", {"pipeline_parallel_size": 2}, None),
        (
            "TieredCacheConnector",
            {"tensor_parallel_size": 3, "distributed_executor_backend": "ray"},
            None,
        ),
        ("TieredCacheConnector", {"tensor_parallel_size": 3}, None),
    ],
)
def test_connectors_say_whether_they_serve_several_ranks(
    connector: str, parallel: dict[str, object], message: str | None
) -> None:
    """Checked in the engine core before any worker starts; TieredCacheConnector and
    SharedStorageConnector serve tensor and pipeline parallelism (each rank its own
    shard), P2pZmqConnector tensor parallelism; the others refuse by name."""
    transfer = json.dumps({"kv_connector": connector})
    config = EngineArgs(kv_transfer_config=transfer, **parallel).create_engine_config()  # type: ignore[arg-type]
    if message is None:
        KVConnectorFactory.check_parallel_config(config)
        return
    with pytest.raises(ValueError, match=message):
        KVConnectorFactory.check_parallel_config(config)

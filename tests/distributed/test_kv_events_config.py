"""KVEventsConfig from Python, from a dict and from `--kv-events-config '<json>'`."""

from __future__ import annotations

import argparse

import pytest

from kvserve.args.engine_args import EngineArgs
from kvserve.config import KVEventsConfig


def test_defaults_and_publisher_resolution() -> None:
    off = KVEventsConfig()
    assert (off.enable_kv_cache_events, off.publisher, off.endpoint) == (
        False,
        "null",
        "tcp://127.0.0.1:5557",  # loopback: the events carry prompts
    )
    assert (off.replay_endpoint, off.buffer_steps, off.topic) == (None, 10_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"
    hash(KVEventsConfig())  # hashable: usable as a key of cached engines


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"publisher": "kafka"}, "publisher"),
        ({"endpoint": ""}, "endpoint"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"hwm": -1}, "hwm"),
        ({"max_queue_size": 0}, "max_queue_size"),
    ],
)
def test_invalid_values_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig(**kwargs)  # type: ignore[arg-type]


def test_cli_json_is_parsed_into_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
            '"replay_endpoint": "tcp://*:6001", "topic": "kv"}',
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.kv_events_config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6001",
        topic="kv",
    )
    assert EngineArgs().create_engine_config().kv_events_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "port": 5557}', "unknown key.*port"),
        ('{"hwm": "big"}', "kv-events-config"),
    ],
)
def test_bad_cli_json_is_a_clear_value_error(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_cli(value)
    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_events_config=value).create_engine_config()


def test_python_values_pass_through() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True)
    assert KVEventsConfig.from_cli(config) is config
    assert KVEventsConfig.from_cli({"enable_kv_cache_events": True}) == config

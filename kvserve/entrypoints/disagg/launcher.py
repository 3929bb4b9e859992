"""`kvserve disagg`: a producer, a consumer and the proxy in front, on one machine.

The two instances are `kvserve serve` child processes on free loopback ports (each in its
own process group, so stopping one takes its engine core along); the proxy runs in this
process on --port. SIGTERM or SIGINT stops the proxy and then both instances.

By default the KV goes straight from producer to consumer (P2pZmqConnector). With
--kv-tier URL (redis://host:port or kvserve://host:port) both instances use the tiered KV
cache over that store instead: the producer stores each prompt's KV there and the
consumer loads it, for instances that cannot reach each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from kvserve.entrypoints.disagg.pool import Instance
from kvserve.entrypoints.disagg.proxy import DisaggProxy, build_app
from kvserve.entrypoints.front_door import UpstreamKeys
from kvserve.entrypoints.openai.cli_args import API_KEY_ENV
from kvserve.entrypoints.openai.tenants import bearer_keys
from kvserve.utils.health import wait_until_healthy
from kvserve.utils.processes import free_port

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


# A consumer at TP=n listens on kv_port .. kv_port + n - 1 (one port per rank).
MAX_KV_PORTS = 8


def free_port_run(count: int = MAX_KV_PORTS) -> int:
    """A port p with p .. p + count - 1 all free now (the consumer's ranks bind them)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65536:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"found no {count} consecutive free ports")


def connector_configs(kv_tier: str | None, kv_port: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The producer's and the consumer's --kv-transfer-config."""
    if kv_tier is None:
        return (
            {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer"},
            {
                "kv_connector": "P2pZmqConnector",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": kv_port},
            },
        )
    # Chunks of one block, the last partial one too: the consumer finds all but at most
    # a block of the prompt. No local CPU tier: every byte goes through the shared store.
    tier = {
        "remote_url": kv_tier,
        "local_cpu": False,
        "chunk_size": 16,
        "save_unfull_chunk": True,
    }
    return (
        {"kv_connector": "TieredCacheConnector", "kv_role": "kv_producer",
         "kv_connector_extra_config": tier},
        {"kv_connector": "TieredCacheConnector", "kv_role": "kv_consumer",
         "kv_connector_extra_config": tier},
    )  # fmt: skip


class Child:
    def __init__(
        self,
        name: str,
        model: str,
        port: int,
        config: dict[str, Any],
        extra: list[str],
        api_key: str | None,
    ):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, "--port", str(port),
            "--kv-transfer-config", json.dumps(config), *extra,
        ]  # fmt: skip
        environment = dict(os.environ)
        if api_key is not None:
            # In the environment, not on the command line other users can list.
            environment[API_KEY_ENV] = api_key
        self.proc = subprocess.Popen(command, start_new_session=True, env=environment)

    def wait_healthy(self, deadline: float) -> None:
        if wait_until_healthy(self.url, self.proc, deadline, interval_s=0.5):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"the {self.name} exited during startup ({self.proc.returncode})")
        raise RuntimeError(f"the {self.name} did not become healthy in {STARTUP_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def add_disagg_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "disagg", help="run a producer, a consumer and the disaggregation proxy locally"
    )
    parser.add_argument("model", nargs="?", default=None, help="the model both instances serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument(
        "--kv-tier", default=None, metavar="URL",
        help="move the KV through this shared store (redis:// or kvserve://) instead of "
        "sending it from producer to consumer",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV),
        help="require `Authorization: Bearer <key>` at the proxy and at both instances "
        "(the proxy sends it to them); default: $KVSERVE_API_KEY",
    )  # fmt: skip
    parser.add_argument(
        "--serve-args", default="",
        help='more `kvserve serve` flags for both instances, e.g. "--kv-cache-memory 256M"',
    )  # fmt: skip
    parser.set_defaults(func=disagg_main)


def disagg_main(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.args.engine_args import EngineArgs

    model = str(args.model or EngineArgs.model)
    extra = shlex.split(args.serve_args)
    kv_port = free_port_run()
    producer_config, consumer_config = connector_configs(args.kv_tier, kv_port)
    children: list[Child] = []
    # SIGTERM during startup must still stop the children: make it an exception until
    # uvicorn installs its own handler (which ends uvicorn.run normally).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for name, config in (("producer", producer_config), ("consumer", consumer_config)):
            children.append(Child(name, model, free_port(), config, extra, args.api_key))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for child in children:
            child.wait_healthy(deadline)
        producer, consumer = children
        decode = Instance(consumer.url)
        if args.kv_tier is None:
            decode = Instance(consumer.url, "127.0.0.1", kv_port)
        proxy = DisaggProxy(
            [Instance(producer.url)], [decode], UpstreamKeys([args.api_key] if args.api_key else [])
        )
        print(
            f"kvserve disagg: proxy on http://{args.host}:{args.port} (producer "
            f"{producer.url}, consumer {consumer.url})",
            file=sys.stderr,
            flush=True,
        )
        app = build_app(proxy, bearer_keys(args.api_key, None))
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.stop()
    return 0

"""`kvserve bench kv-transfer`: bandwidth of P2pZmqConnector's transport on this machine.

A producer-side PeerSender pushes whole transfers (every layer's blocks of one prompt, as
P2pZmqConnector's save_kv_layer gathers them) to a consumer-side Receiver over loopback
TCP; a transfer counts from its first layer queued until the consumer's acknowledgement
came back and the layers were claimed. The default shape is SmolLM2-135M's KV (30 layers,
3 KV heads of 64, float32) for a 512-token prompt. --curve encrypts the sockets as a KV
secret does (kvserve.utils.zmq_curve), to measure what CURVE costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import zmq

from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
    Arrival,
    LayerHeader,
    PeerSender,
    Receiver,
)
from kvserve.utils.processes import free_port
from kvserve.utils.zmq_curve import PLAIN_SOCKETS, SocketSecurity, socket_security


def run(
    layers: int,
    tokens: int,
    kv_heads: int,
    head_size: int,
    dtype: str,
    transfers: int,
    security: SocketSecurity = PLAIN_SOCKETS,
) -> dict[str, float]:
    block = 16
    num_blocks = -(-tokens // block)
    torch_dtype = getattr(torch, dtype)
    kv = [
        torch.randn(2, num_blocks, block, kv_heads, head_size).to(torch_dtype)
        for _ in range(layers)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in kv)
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = Receiver(address, 4 * nbytes, ttl_s=60, security=security)
    context = zmq.Context()
    sender = PeerSender(context, address, timeout_s=60, security=security)
    seconds: list[float] = []
    try:
        for i in range(transfers + 1):  # the first one warms the connection up
            transfer_id = f"bench-{i}"
            start = time.perf_counter()
            for index, t in enumerate(kv):
                header = LayerHeader(
                    transfer_id=transfer_id, layer_index=index, num_layers=layers,
                    layer_name=f"layer.{index}", dtype=dtype, shape=list(t.shape),
                    num_tokens=tokens, prompt_hash="bench",
                )  # fmt: skip
                sender.send_layer(transfer_id, header, t)
            done: list[tuple[str, bool, int, float]] = []
            while not done:
                done = sender.take_done()
                time.sleep(0.0005)
            arrival = receiver.take(transfer_id)
            assert isinstance(arrival, Arrival) and done[0][1], (arrival, done)
            if i:
                seconds.append(time.perf_counter() - start)
    finally:
        sender.close()
        receiver.close()
        context.term()
    median = statistics.median(seconds)
    return {
        "transfer_bytes": nbytes,
        "transfers": transfers,
        "median_seconds": median,
        "median_gb_per_s": nbytes / median / 1e9,
        "best_gb_per_s": nbytes / min(seconds) / 1e9,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per transfer")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--transfers", type=int, default=20)
    parser.add_argument(
        "--curve", action="store_true", help="CURVE-encrypted sockets (a random KV secret)"
    )


def main(args: argparse.Namespace) -> int:
    result = run(
        args.layers,
        args.tokens,
        args.kv_heads,
        args.head_size,
        args.dtype,
        args.transfers,
        socket_security(os.urandom(32)) if args.curve else PLAIN_SOCKETS,
    )
    print(json.dumps(result, indent=2))
    return 0

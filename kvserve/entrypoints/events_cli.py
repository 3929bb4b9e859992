"""`kvserve events ENDPOINT`: print an engine's KV cache events, one JSON line per event.

Each line is {"seq": N, "ts": T, "type": "BlockStored" | "BlockRemoved" |
"AllBlocksCleared", ...the event's fields}, block hashes as hex strings. With --replay
the batches buffered since --from-seq are printed first, then the live stream, without
repeating a sequence number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvserve.distributed.kv_events_subscriber import KVEventSubscriber, event_to_dict
from kvserve.protocol.kv_events import KVEventBatch
from kvserve.utils.kv_secret import add_kv_secret_arg, read_kv_secret
from kvserve.utils.zmq_curve import socket_security


def add_events_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "events", help="print an engine's KV cache events as JSON lines"
    )
    parser.add_argument("endpoint", help="the publisher's PUB endpoint, e.g. tcp://host:5557")
    parser.add_argument("--replay", default=None, metavar="ENDPOINT", help="replay endpoint")
    parser.add_argument(
        "--from-seq", type=int, default=0, help="with --replay: first sequence number to fetch"
    )
    parser.add_argument("--topic", default="", help="only messages whose topic starts with this")
    add_kv_secret_arg(parser)
    parser.add_argument("--count", type=int, default=None, help="exit after this many events")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="exit after this many seconds without a message (exit 1 if --count was not met)",
    )
    parser.set_defaults(func=cmd_events)
    return parser


class _Printer:
    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.printed = 0
        self.last_seq: int | None = None

    @property
    def done(self) -> bool:
        return self.limit is not None and self.printed >= self.limit

    def batch(self, seq: int, batch: KVEventBatch) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            return  # already printed from the replay
        if self.last_seq is not None and seq > self.last_seq + 1:
            print(f"kvserve events: batches {self.last_seq + 1}..{seq - 1} missed", file=sys.stderr)
        self.last_seq = seq
        for event in batch.events:
            if self.done:
                return
            line = {"seq": seq, "ts": batch.ts, **event_to_dict(event)}
            sys.stdout.write(json.dumps(line) + "\n")
            self.printed += 1
        sys.stdout.flush()


def cmd_events(args: argparse.Namespace) -> int:
    printer = _Printer(args.count)
    # Subscribe before asking for the replay, so nothing falls between the two.
    security = socket_security(read_kv_secret(args.kv_secret_file))
    with KVEventSubscriber(args.endpoint, args.replay, args.topic, security) as subscriber:
        if args.replay is not None:
            for seq, batch in subscriber.replay(args.from_seq, timeout=args.timeout or 10.0):
                printer.batch(seq, batch)
        deadline_s = args.timeout
        last_message = time.monotonic()
        try:
            while not printer.done:
                left = (
                    None if deadline_s is None else deadline_s - (time.monotonic() - last_message)
                )
                if left is not None and left <= 0:
                    break
                received = subscriber.recv(timeout=left)
                if received is None:
                    break
                last_message = time.monotonic()
                printer.batch(*received)
        except KeyboardInterrupt:
            return 0
    if args.count is not None and not printer.done:
        print(
            f"kvserve events: timed out after {printer.printed} of {args.count} events",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_events_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["events", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

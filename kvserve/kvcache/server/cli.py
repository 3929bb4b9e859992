"""`kvserve cache-server`: runs CacheServer until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvserve.kvcache.config import parse_size
from kvserve.kvcache.server.server import CacheServer
from kvserve.utils.secret_file import read_secret_file

logger = logging.getLogger(__name__)
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--max-memory", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument(
        "--max-payload", type=parse_size, default=None, help="cap on one value (default: memory)"
    )
    parser.add_argument("--spill-dir", default=None, help="spill evicted chunks to this directory")
    parser.add_argument("--max-spill", type=parse_size, default=parse_size("10GiB"))
    parser.add_argument(
        "--auth-token-file",
        default=None,
        help="a file (mode 600) holding the token every client must present first (engines: "
        "the tier's remote_auth_token_file); without it, anyone who reaches the port can "
        "read and write chunks",
    )


def add_cache_server_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache-server", help="run a KV cache server (remote tier for kvserve://host:port)"
    )
    add_cli_args(parser)
    parser.set_defaults(func=cmd_cache_server)
    return parser


async def _run(args: argparse.Namespace) -> None:
    token = None
    if args.auth_token_file is not None:
        try:
            token = read_secret_file(args.auth_token_file, "--auth-token-file")
        except ValueError as exc:
            raise SystemExit(f"kvserve cache-server: {exc}") from None
    elif args.host not in LOOPBACK:
        logger.warning(
            "kvserve cache-server on %s without --auth-token-file: anyone who reaches it "
            "can read and write KV chunks",
            args.host,
        )
    server = CacheServer(
        args.host,
        args.port,
        max_bytes=args.max_memory,
        max_payload_bytes=args.max_payload,
        spill_dir=args.spill_dir,
        max_spill_bytes=args.max_spill,
        auth_token=token,
    )
    host, port = await server.start()
    # Tests and scripts read this line to learn the port when --port 0 was given.
    print(f"kvserve cache-server listening on {host}:{port}", flush=True)
    await server.serve_forever()


def cmd_cache_server(args: argparse.Namespace) -> int:
    try:
        asyncio.run(_run(args))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve cache-server", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    return cmd_cache_server(args)


if __name__ == "__main__":
    sys.exit(main())

"""The operator's KV secret: ``--kv-secret-file PATH``, else the environment variable
KVSERVE_KV_SECRET. It keys the MAC on KV that leaves an engine (kvserve.kvcache.integrity)
and the CURVE keys of sockets that cross hosts (kvserve.utils.zmq_curve). Here, torch-free,
so that `kvserve events` and `kvserve router` read it the way engines do."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from kvserve.utils.secret_file import read_secret_file

ENV_SECRET = "KVSERVE_KV_SECRET"
MIN_SECRET_BYTES = 16


class KVSecurityError(ValueError):
    """KV would leave (or enter) the engine unauthenticated, or the secret is unusable."""


def read_kv_secret(
    secret_file: str | None, environ: Mapping[str, str] | None = None
) -> bytes | None:
    """The secret from the file (its first line, a file only its owner may read), else
    the environment."""
    env = os.environ if environ is None else environ
    if secret_file:
        try:
            return read_secret_file(secret_file, "--kv-secret-file").encode()
        except ValueError as exc:  # unreadable, empty, or readable by other users
            raise KVSecurityError(str(exc)) from None
    value = env.get(ENV_SECRET, "").strip()
    return value.encode() if value else None


def check_secret_length(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise KVSecurityError(
            f"the KV secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            "random bytes (e.g. `head -c 32 /dev/urandom | base64 > kv.secret`)"
        )


def add_kv_secret_arg(parser: argparse.ArgumentParser) -> None:
    """--kv-secret-file for commands that talk to engines' KV sockets (events, router)."""
    parser.add_argument(
        "--kv-secret-file",
        default=None,
        metavar="PATH",
        help="the engines' KV secret (else the environment variable "
        f"{ENV_SECRET}): KV event sockets use CURVE keys derived from it",
    )

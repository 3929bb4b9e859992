"""Secrets that operators keep in files (tokens, keys): passed by path, so they are not on
a command line that every user of the machine can list."""

from __future__ import annotations

import os
import stat


def read_secret_file(path: str, what: str) -> str:
    """The secret in ``path`` (its first line, stripped); ValueError naming ``what`` when the
    file is missing, empty, or readable by other users (a secret anyone can read is none)."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what}: {path} is readable by other users; chmod 600 it")
    if not secret:
        raise ValueError(f"{what}: {path} holds no secret")
    return secret

"""SocketSecurity: CURVE encryption and client authentication for the ZMQ sockets that may
cross hosts (KV events, P2P KV transfer, the tier's lookup service over TCP), keyed by
the operator's KV secret (kvserve.utils.kv_secret).

Both keypairs derive from the secret (keyed BLAKE3 ``derive_key`` under two contexts), so
every process holding it agrees on them and nothing else is distributed. A server accepts
only clients presenting the derived client public key (a ZAP authenticator per ZMQ
Context); a client accepts only the server holding the derived server secret key. A peer
with another secret (or none) fails the handshake before any message reaches the
application: a subscriber receives nothing, a P2P transfer fails into the load-failure
policy, a lookup is a miss. The server side logs each refusal at WARNING, once per
endpoint (then at most once a minute with the count since).

A peer with another secret cannot decrypt the client's HELLO, so ZMQ refuses it before
ZAP is asked: a socket monitor is what sees those (the endpoint is the server's own; ZMQ
does not say who connected). ZAP sees, with the peer's address, a client that knows the
server key but not the client key.

Without a secret, SocketSecurity is the plain form: sockets are left as they are.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import blake3
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvserve.utils.kv_secret import check_secret_length

logger = logging.getLogger(__name__)

_SERVER_CONTEXT = "kvserve 2025 ZMQ CURVE server key v1"
_CLIENT_CONTEXT = "kvserve 2025 ZMQ CURVE client key v1"
LOG_INTERVAL_S = 60.0
# ZAP's own refusals (HANDSHAKE_FAILED_AUTH) are logged by the authenticator, with the peer.
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_monitor_ids = itertools.count()


@dataclass(frozen=True)
class CurveKeys:
    """The two CURVE keypairs, z85-encoded as ZMQ's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        check_secret_length(secret)
        server = z85.encode(blake3.blake3(secret, derive_key_context=_SERVER_CONTEXT).digest())
        client = z85.encode(blake3.blake3(secret, derive_key_context=_CLIENT_CONTEXT).digest())
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)


class SocketSecurity:
    """The plain form: no secret, sockets stay as they are. CurveSecurity encrypts;
    callers hold either and never test for a secret themselves."""

    encrypted = False

    def curve_server(self, socket: zmq.Socket[Any]) -> None:
        """Call before bind: the socket accepts only clients holding the secret."""
        return None

    def curve_client(self, socket: zmq.Socket[Any]) -> None:
        """Call before connect: the socket talks only to a server holding the secret."""
        return None

    def refused(self, context: zmq.Context[Any]) -> int:
        """Connections the servers of ``context`` refused in the handshake."""
        return 0

    def term(self, context: zmq.Context[Any]) -> None:
        """Terminates ``context`` (its sockets closed), stopping its authenticator first."""
        context.term()


class CurveSecurity(SocketSecurity):
    encrypted = True

    def __init__(self, keys: CurveKeys) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self._guards: dict[zmq.Context[Any], _CurveGuard] = {}

    def curve_server(self, socket: zmq.Socket[Any]) -> None:
        with self._lock:
            guard = self._guards.get(socket.context)
            if guard is None:
                guard = self._guards[socket.context] = _CurveGuard(socket.context, self.keys)
        socket.curve_server = True
        socket.curve_secretkey = self.keys.server_secret
        guard.watch(socket)

    def curve_client(self, socket: zmq.Socket[Any]) -> None:
        socket.curve_serverkey = self.keys.server_public
        socket.curve_publickey = self.keys.client_public
        socket.curve_secretkey = self.keys.client_secret

    def refused(self, context: zmq.Context[Any]) -> int:
        guard = self._guards.get(context)
        return 0 if guard is None else guard.refusals.count

    def term(self, context: zmq.Context[Any]) -> None:
        with self._lock:
            guard = self._guards.pop(context, None)
        if guard is not None:
            guard.stop()
        context.term()


PLAIN_SOCKETS = SocketSecurity()


def socket_security(secret: bytes | None) -> SocketSecurity:
    """CURVE with keys from the KV secret (kvserve.utils.kv_secret.read_kv_secret), plain
    without one."""
    return PLAIN_SOCKETS if secret is None else CurveSecurity(CurveKeys.from_secret(secret))


class RefusalLog:
    """Logs refused peers: the first at each place at once, later ones at most every
    LOG_INTERVAL_S seconds with how many came since (a misconfigured peer reconnects
    every 100 ms)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._places: dict[str, tuple[float, int]] = {}  # place -> (last logged, unlogged)
        self.count = 0

    def record(self, place: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            last, unlogged = self._places.get(place, (-LOG_INTERVAL_S, 0))
            if now - last < LOG_INTERVAL_S:
                self._places[place] = (last, unlogged + 1)
                return
            self._places[place] = (now, 0)
        logger.warning(
            "refused a ZMQ peer %s: %s. It does not hold this process's KV secret (a "
            "different --kv-secret-file, none, or a plaintext client)%s",
            place,
            why,
            f"; {unlogged} more since the last report" if unlogged else "",
        )


class _Authenticator(ThreadAuthenticator):
    """ZAP for one Context: only the derived client public key passes."""

    def __init__(self, context: zmq.Context[Any], client_public: bytes, log: RefusalLog) -> None:
        super().__init__(context)
        self._client_public = client_public
        self._refusals = log
        self._peer = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The credentials callback is not told who asks; the ZAP request is.
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._client_public):
            return True
        self._refusals.record(f"from {self._peer}", "an unknown CURVE client key")
        return False


class _CurveGuard:
    """A Context's ZAP authenticator and the thread that watches its CURVE servers'
    monitor sockets for failed handshakes."""

    def __init__(self, context: zmq.Context[Any], keys: CurveKeys) -> None:
        self.refusals = RefusalLog()
        self._context = context
        self._auth = _Authenticator(context, keys.client_public, self.refusals)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self._auth)
        self._new: queue.Queue[str] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="zmq-curve", daemon=True)
        self._thread.start()

    def watch(self, socket: zmq.Socket[Any]) -> None:
        address = f"inproc://kvserve-curve-monitor-{os.getpid()}-{next(_monitor_ids)}"
        socket.monitor(address, _REFUSALS)
        self._new.put(address)
        os.write(self._wake_w, b"w")

    def stop(self) -> None:
        os.write(self._wake_w, b"s")
        self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._auth.stop()

    def _run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        monitors: list[zmq.Socket[bytes]] = []
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    if b"s" in os.read(self._wake_r, 64):
                        return
                    while not self._new.empty():
                        monitor = self._context.socket(zmq.PAIR)
                        monitor.connect(self._new.get())
                        poller.register(monitor, zmq.POLLIN)
                        monitors.append(monitor)
                for monitor in monitors:
                    while monitor in events and monitor.poll(0):
                        event = parse_monitor_message(monitor.recv_multipart())
                        if event["event"] & _REFUSALS:
                            endpoint = event["endpoint"].decode(errors="replace")
                            self.refusals.record(f"at {endpoint}", "the CURVE handshake failed")
        finally:
            for monitor in monitors:
                monitor.close(linger=0)

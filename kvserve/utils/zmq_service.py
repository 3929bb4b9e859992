"""A ZMQ ROUTER socket answered on a daemon thread: the request/reply loop that the KV
tier's lookup and control services share."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import zmq

Buffer = bytes | bytearray | memoryview
# Gets a message's frames after the sender's identity; returns the reply's frames, or
# None to drop the message unanswered (not a client of ours).
Handler = Callable[[Sequence[zmq.Frame]], Sequence[Buffer] | None]


class RouterService:
    """Owns the thread serving one bound ROUTER socket; the socket stays its creator's.

    close() wakes the poll through a pipe rather than closing the socket under it (a
    ZMQ socket must not be used from two threads)."""

    def __init__(self, socket: zmq.Socket[bytes], handle: Handler, name: str) -> None:
        self._socket = socket
        self._handle = handle
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            if len(frames) < 2:
                continue
            reply = self._handle(frames[1:])
            if reply is not None:
                self._socket.send_multipart([frames[0].bytes, *reply], copy=False)

    def close(self) -> None:
        """Stops the thread; the caller closes the socket afterwards."""
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

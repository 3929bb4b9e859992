"""The handshake of an engine core that the front end did not spawn (a ``--headless``
node's core, a Ray actor's core) with the front end's DP handshake server
(engine/dp_remote.py), on one ZMQ DEALER -> ROUTER connection per core.

The core says who it is (``CoreHelloMessage``), the front end answers with the
addresses of the two sockets it bound for that rank (``CoreAddressesMessage``), and the
core, once its model is loaded, answers with the same ReadyMessage / StartupErrorMessage
a spawned core writes to its pipe. The connection then stays open for the core's life:
its end is the front end's sign that the core is gone, and ``CoreShutdownMessage`` on
it asks the core to exit. Every frame is a msgpack-encoded tagged struct.
"""

from __future__ import annotations

import msgspec

from kvserve.protocol.core_messages import ReadyMessage, StartupErrorMessage


class CoreHelloMessage(msgspec.Struct, tag="hello", array_like=True):
    rank: int
    host: str
    pid: int


class CoreAddressesMessage(msgspec.Struct, tag="addresses", array_like=True):
    input_address: str
    output_address: str


class CoreShutdownMessage(msgspec.Struct, tag="shutdown", array_like=True):
    pass


# Core -> front end.
CoreHandshakeMessage = CoreHelloMessage | ReadyMessage | StartupErrorMessage
# Front end -> core.
FrontEndHandshakeMessage = CoreAddressesMessage | CoreShutdownMessage

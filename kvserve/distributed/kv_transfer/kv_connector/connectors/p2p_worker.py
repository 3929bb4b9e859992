"""P2pZmqConnector's worker side: sends each layer's prompt blocks as the forward writes
them, and copies arrived transfers into the blocks of the requests that wait for them.

Loads land between steps (in get_finished, on the worker's own thread), so a request
aborted while its KV is on the way drops its pending load, in the step that reports the
abort, before its blocks can be written. Also the plans the scheduler side sends here.

Under tensor parallelism each rank sends and receives its own KV heads (to and from the
peer's same rank) and the ranks agree in get_finished, vLLM's KV output aggregation done
as one collective: every rank holds the same pending sends and loads (they follow the same
metadata), gathers every rank's state of each, and reports a request only once every rank
has ended it; a load that failed on any rank fails on all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorMetadata
from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import AUTH_FAILED
from kvserve.distributed.kv_transfer.kv_connector.utils import add_worker_total

if TYPE_CHECKING:
    import torch

    from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
        PeerSender,
        Receiver,
    )
    from kvserve.distributed.parallel_state import GroupCoordinator
    from kvserve.forward_context import ForwardContext
    from kvserve.kvcache.integrity import KVAuthenticator
    from kvserve.utils.zmq_curve import SocketSecurity

logger = logging.getLogger(__name__)

# How a load ended on one rank, as gathered: None still on the way, True copied in, False failed.
_LOAD_STATE = {None: 0, True: 1, False: 2}


@dataclass
class SaveSpec:
    req_id: str
    transfer_id: str
    remote_host: str
    remote_port: int  # the consumer's rank 0; rank r listens at remote_port + r
    block_ids: list[int]  # the blocks holding tokens [0, num_tokens)
    num_tokens: int
    prompt_hash: str
    stop_after_layers: int | None = None
    stop_tp_rank: int | None = None  # fault injection on one rank only (None: all)

    def address(self, tp_rank: int) -> str:
        return f"tcp://{self.remote_host}:{self.remote_port + tp_rank}"


@dataclass
class LoadSpec:
    req_id: str
    transfer_id: str
    block_ids: list[int]  # the request's blocks; [start_block, end_block) are loaded
    start_block: int
    end_block: int
    num_tokens: int
    prompt_hash: str


@dataclass
class P2pMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[str] = field(default_factory=list)  # transfer ids nobody will claim


class P2pWorkerSide:
    """Mixed into P2pZmqConnector: the worker role's hooks."""

    engine_id: str
    recv_timeout_s: float
    send_timeout_s: float

    if TYPE_CHECKING:

        def _get_connector_metadata(self) -> KVConnectorMetadata: ...

    def _init_worker_side(
        self,
        receiver: Receiver | None,
        tp_rank: int,
        tp_size: int,
        auth: KVAuthenticator,
        security: SocketSecurity,
    ) -> None:
        self._auth = auth
        self._security = security
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._tp: GroupCoordinator | None = None
        if tp_size > 1:
            from kvserve.distributed.parallel_state import get_tp_group

            self._tp = get_tp_group()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._senders: dict[str, PeerSender] = {}
        self._zmq_context: Any = None
        self._in_flight: set[str] = set()  # requests with an unfinished transfer
        self._finished: set[str] = set()  # finished by the scheduler, blocks maybe sending
        self._recvs: dict[str, tuple[LoadSpec, float]] = {}  # req_id -> (spec, deadline)
        # Loads this rank ended (True: copied in), until every rank has ended them.
        self._recv_ended: dict[str, bool] = {}
        self._load_errors: set[int] = set()
        self._receiver = receiver
        # This rank's own view: transfers it copied in or saw fail (tests read it per rank).
        self.rank_transfers = {"received": 0, "failed": 0, "auth_failures": 0}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pMetadata)
        deadline = time.monotonic() + self.recv_timeout_s
        for spec in meta.loads:
            self._recvs[spec.req_id] = (spec, deadline)
        if self._receiver is not None:
            for transfer_id in meta.discards:
                self._receiver.discard(transfer_id)
        for save in meta.saves:
            self._in_flight.add(save.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads land between steps, before their requests run

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, P2pMetadata)
        if not meta.saves:
            return
        import torch

        from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import LayerHeader

        index = self._layer_index[layer_name]
        for save in meta.saves:
            stops = save.stop_tp_rank is None or save.stop_tp_rank == self._tp_rank
            if stops and save.stop_after_layers is not None and index >= save.stop_after_layers:
                continue
            ids = torch.tensor(save.block_ids, dtype=torch.long, device=kv_layer.device)
            # A gathered copy: the send overlaps the next layers and reads no live block.
            blocks = kv_layer[:, ids].to("cpu").contiguous()
            header = LayerHeader(
                transfer_id=save.transfer_id,
                layer_index=index,
                num_layers=len(self._kv_caches),
                layer_name=layer_name,
                dtype=str(blocks.dtype).removeprefix("torch."),
                shape=list(blocks.shape),
                num_tokens=save.num_tokens,
                prompt_hash=save.prompt_hash,
                tp_rank=self._tp_rank,
                tp_size=self._tp_size,
            )
            self._sender(save.address(self._tp_rank)).send_layer(save.req_id, header, blocks)

    def _sender(self, address: str) -> PeerSender:
        sender = self._senders.get(address)
        if sender is None:
            import zmq

            from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
                PeerSender,
            )

            if self._zmq_context is None:
                self._zmq_context = zmq.Context()
            sender = PeerSender(
                self._zmq_context, address, self.send_timeout_s, self._auth, self._security
            )
            self._senders[address] = sender
        return sender

    def wait_for_save(self) -> None:
        return None  # sends go on in the background; get_finished reports them

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for sender in self._senders.values():
            for req_id, ok, _num_bytes, seconds in sender.take_done():
                self._in_flight.discard(req_id)
                if ok:
                    add_worker_total(self.engine_id, "transfer_seconds", "sent", seconds)
        self._finished |= finished_req_ids
        self._poll_recvs(finished_req_ids)
        # The same lists on every rank (same metadata, same finished ids): one gather.
        finished = sorted(self._finished)
        loading = sorted(self._recvs)
        local = [int(r not in self._in_flight) for r in finished]
        local += [_LOAD_STATE[self._recv_ended.get(r)] for r in loading]
        states = self._gather(local)
        sending = {r for i, r in enumerate(finished) if min(s[i] for s in states)}
        self._finished -= sending
        done: set[str] = set()
        for i, req_id in enumerate(loading, start=len(finished)):
            ended = [s[i] for s in states]
            if 2 in ended:  # failed on some rank: on every rank, now
                self._end_load(req_id, failed=True)
            elif min(ended):
                self._end_load(req_id, failed=False)
            else:
                continue
            done.add(req_id)
        return sending or None, done or None

    def _gather(self, values: list[int]) -> list[list[int]]:
        """Every TP rank's values, by rank (just this rank's without TP)."""
        if self._tp is None or not values:
            return [values]
        import torch

        gathered = self._tp.all_gather(torch.tensor(values, dtype=torch.int64), dim=0)
        return gathered.view(self._tp_size, -1).tolist()

    def _end_load(self, req_id: str, failed: bool) -> None:
        """Every rank agreed this load ended: a failed one is recomputed from its blocks."""
        spec, _ = self._recvs.pop(req_id)
        if self._recv_ended.pop(req_id, None) is None and self._receiver is not None:
            self._receiver.discard(spec.transfer_id)  # still on the way here: never needed
        if failed:  # the scheduler side counts it (it sees the load errors)
            self._load_errors.update(spec.block_ids[spec.start_block : spec.end_block])

    def _poll_recvs(self, finished_req_ids: set[str]) -> None:
        """Copies every arrived transfer into its blocks and notes, per request, how its
        load ended on this rank (failures are logged here, reported once agreed)."""
        receiver = self._receiver
        if receiver is None:
            return
        now = time.monotonic()
        for req_id, (spec, deadline) in list(self._recvs.items()):
            if req_id in finished_req_ids:  # aborted: its blocks may be someone else's now
                receiver.discard(spec.transfer_id)
                del self._recvs[req_id]
                self._recv_ended.pop(req_id, None)
                continue
            if req_id in self._recv_ended:
                continue
            arrival = receiver.take(spec.transfer_id)
            why: str | None = None
            if isinstance(arrival, str):
                why = arrival
            elif arrival is not None:
                why = self._copy_in(spec, arrival)
            elif now > deadline:
                receiver.discard(spec.transfer_id)
                why = f"not arrived within {self.recv_timeout_s}s"
            else:
                continue
            if why is not None:
                logger.warning("KV load of transfer %s failed: %s", spec.transfer_id, why)
            if why == AUTH_FAILED:
                self.rank_transfers["auth_failures"] += 1
                add_worker_total(self.engine_id, "transfer_auth_failures", "received", 1)
            self.rank_transfers["failed" if why else "received"] += 1
            self._recv_ended[req_id] = why is None

    def _copy_in(self, spec: LoadSpec, arrival: Any) -> str | None:
        """Writes the arrived layers into the request's blocks; the reason it could not."""
        import torch

        if arrival.prompt_hash != spec.prompt_hash or arrival.num_tokens < spec.num_tokens:
            return "the transfer holds KV of other tokens"
        ids = torch.tensor(spec.block_ids[spec.start_block : spec.end_block], dtype=torch.long)
        for name, cache in self._kv_caches.items():
            kv = arrival.layers.get(name)
            if kv is None:
                return f"layer {name} is missing"
            if (
                kv.dtype != cache.dtype
                or kv.shape[0] != cache.shape[0]
                or (kv.shape[2:] != cache.shape[2:] or kv.shape[1] < spec.end_block)
            ):
                return f"layer {name}: {tuple(kv.shape)} {kv.dtype} does not fit the cache"
            cache[:, ids.to(cache.device)] = kv[:, spec.start_block : spec.end_block].to(
                cache.device
            )
        seconds = max(arrival.last_at - arrival.first_at, 0.0)
        add_worker_total(self.engine_id, "transfer_seconds", "received", seconds)
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders = {}
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._zmq_context is not None:
            self._zmq_context.term()
            self._zmq_context = None

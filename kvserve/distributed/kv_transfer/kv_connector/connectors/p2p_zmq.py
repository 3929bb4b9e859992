"""P2pZmqConnector: disaggregated prefill, KV pushed from a producer to a consumer over ZMQ.

Producer (kv_producer): a request with kv_transfer_params {"do_remote_decode": true,
"remote_host", "remote_port"} is prefilled as usual; in the step that completes its prompt,
every attention layer's blocks of the prompt go to that consumer as soon as the layer has
written them (save_kv_layer). The request's blocks stay held (request_finished delays the
free) until the consumer acknowledged the whole transfer, refused it, or send_timeout_s
passed. Its final output carries the params a consumer needs (see p2p_params).

Consumer (kv_consumer, listening at kv_host:kv_port): a request with those params loads
the prompt but its last token from the transfer: it takes its blocks, waits in
WAITING_FOR_REMOTE_KVS until all layers arrived, has them copied into its blocks and then
computes just the last prompt token and decodes. KV that does not arrive within
recv_timeout_s (a producer that died, a transfer refused) is reported as a load error: the
scheduler recomputes the prompt or fails the request, per kv_load_failure_policy.

One KV cache group of full attention, one worker (tensor parallel size 1). Per request,
"fault_stop_after_layers": N makes the producer send only its first N layers (fault
injection for tests: the consumer then sees a transfer that never completes).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.distributed.kv_transfer.kv_connector.base import (
    ConnectorBlocks,
    ConnectorRequest,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_params import (
    RecvParams,
    SendParams,
    parse_recv,
    parse_send,
    prompt_hash,
)
from kvserve.distributed.kv_transfer.kv_connector.utils import follow_scheduled_blocks

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
        PeerSender,
        Receiver,
    )
    from kvserve.forward_context import ForwardContext
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

# The worker runs in the engine core's process (one worker): it leaves its totals (transfer
# seconds, failed loads) here for the scheduler side's stats, per engine id.
_WORKER_TOTALS: dict[str, dict[str, dict[str, float]]] = {}
_TOTALS_LOCK = threading.Lock()


def _add_total(engine_id: str, metric: str, kind: str, value: float) -> None:
    with _TOTALS_LOCK:
        totals = _WORKER_TOTALS.setdefault(engine_id, {}).setdefault(metric, {})
        totals[kind] = totals.get(kind, 0.0) + value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SaveSpec:
    req_id: str
    transfer_id: str
    address: str
    block_ids: list[int]  # the blocks holding tokens [0, num_tokens)
    num_tokens: int
    prompt_hash: str
    stop_after_layers: int | None = None


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


@dataclass
class _Send:
    """Scheduler side: a producer request, followed until its prompt is sent."""

    params: SendParams
    transfer_id: str
    prompt_token_ids: list[int]
    block_ids: list[list[int]]
    stop_after_layers: int | None
    spec: SaveSpec | None = None  # set once the save is planned


class P2pZmqConnector(KVConnectorBase_V1):
    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        transfer = self.kv_transfer_config
        if config.parallel_config.world_size != 1:
            raise ValueError("P2pZmqConnector serves one worker (tensor parallel size 1)")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        if len(groups) > 1 or any(not g.kv_cache_spec.attends_to_all for g in groups):
            raise ValueError("P2pZmqConnector serves one KV cache group of full attention")
        self.block_size = config.cache_config.block_size
        self.engine_id = str(transfer.engine_id)
        self.kv_host = str(transfer.get_from_extra_config("kv_host", "127.0.0.1"))
        port = transfer.get_from_extra_config("kv_port", None)
        if transfer.is_kv_consumer and not isinstance(port, int):
            raise ValueError(
                "P2pZmqConnector as kv_consumer needs kv_connector_extra_config['kv_port'] "
                f"(the port producers send to), got {port!r}"
            )
        self.kv_port = port
        self.send_timeout_s = float(transfer.get_from_extra_config("send_timeout_s", 30.0))
        self.recv_timeout_s = float(transfer.get_from_extra_config("recv_timeout_s", 30.0))
        self.bytes_per_block = 0
        if groups:
            spec = groups[0].kv_cache_spec
            self.bytes_per_block = spec.page_size_bytes * len(groups[0].layer_names)
        # Scheduler side.
        self._sends: dict[str, _Send] = {}
        self._recv_lookups: dict[str, RecvParams] = {}  # admitted-to-be, checked params
        self._loading: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()  # loaded once: a preempted request recomputes
        self._pending_loads: list[LoadSpec] = []
        self._pending_discards: list[str] = []
        self._stats: dict[str, dict[str, float]] = {}
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._senders: dict[str, PeerSender] = {}
        self._zmq_context: Any = None
        self._in_flight: set[str] = set()  # requests with an unfinished transfer
        self._finished: set[str] = set()  # finished by the scheduler, blocks maybe sending
        self._recvs: dict[str, tuple[LoadSpec, float]] = {}  # req_id -> (spec, deadline)
        self._load_errors: set[int] = set()
        self._receiver: Receiver | None = None
        if role == KVConnectorRole.WORKER and transfer.is_kv_consumer:
            from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
                Receiver,
            )

            self._receiver = Receiver(
                f"tcp://{self.kv_host}:{self.kv_port}",
                int(transfer.get_from_extra_config("max_buffer_bytes", 1 << 30)),
                float(transfer.get_from_extra_config("buffer_ttl_s", 120.0)),
            )

    def _count(self, metric: str, kind: str, value: float = 1.0) -> None:
        totals = self._stats.setdefault(metric, {})
        totals[kind] = totals.get(kind, 0.0) + value

    # ---- scheduler side --------------------------------------------------------------------

    def _params(self, request: ConnectorRequest, parse: Any) -> Any:
        try:
            return parse(request.kv_transfer_params)
        except ValueError as exc:  # bad params cost a recompute, never the engine
            logger.warning("request %s: %s; ignored", request.request_id, exc)
            return None

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        if not self.kv_transfer_config.is_kv_consumer or req_id in self._loaded:
            return 0, False
        params: RecvParams | None = self._recv_lookups.get(req_id) or self._params(
            request, parse_recv
        )
        if params is None:
            return 0, False
        n = params.num_tokens
        prompt = request.prompt_token_ids
        if n >= len(prompt) or prompt_hash(list(prompt[:n])) != params.prompt_hash:
            logger.warning(
                "request %s: transfer %s holds KV of other tokens than its prompt; computing "
                "it here", req_id, params.transfer_id,
            )  # fmt: skip
            self._loaded.add(req_id)
            self._pending_discards.append(params.transfer_id)
            return 0, False
        self._recv_lookups[req_id] = params
        if n <= num_computed_tokens:
            return 0, False
        return n - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        recv = self._recv_lookups.pop(req_id, None)
        if recv is not None:
            self._loaded.add(req_id)
            if num_external_tokens <= 0:  # the local prefix cache had it all
                self._pending_discards.append(recv.transfer_id)
            else:
                spec = LoadSpec(
                    req_id,
                    recv.transfer_id,
                    block_ids[0],
                    (recv.num_tokens - num_external_tokens) // self.block_size,
                    _cdiv(recv.num_tokens, self.block_size),
                    recv.num_tokens,
                    recv.prompt_hash,
                )
                self._loading[req_id] = spec
                self._pending_loads.append(spec)
        if not self.kv_transfer_config.is_kv_producer or req_id in self._sends:
            return
        send = self._params(request, parse_send)
        if send is not None:
            params = request.kv_transfer_params or {}
            stop = params.get("fault_stop_after_layers")
            self._sends[req_id] = _Send(
                send,
                send.transfer_id or f"{self.engine_id}-{req_id}-{uuid.uuid4().hex[:8]}",
                list(request.prompt_token_ids),
                block_ids,
                stop if isinstance(stop, int) and not isinstance(stop, bool) else None,
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = P2pMetadata(loads=self._pending_loads, discards=self._pending_discards)
        self._pending_loads, self._pending_discards = [], []
        if not self._sends:
            return meta
        for req_id, computed in follow_scheduled_blocks(scheduler_output, self._sends):
            send = self._sends.get(req_id)
            if send is None or send.spec is not None:
                continue
            num_prompt = len(send.prompt_token_ids)
            if computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) < num_prompt:
                continue  # its prompt completes in a later step: sent then, all of it
            n = num_prompt - 1  # the consumer computes the last token itself
            send.spec = SaveSpec(
                req_id,
                send.transfer_id,
                send.params.address,
                send.block_ids[0][: _cdiv(n, self.block_size)],
                n,
                prompt_hash(send.prompt_token_ids[:n]),
                send.stop_after_layers,
            )
            meta.saves.append(send.spec)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        bad = connector_output.invalid_block_ids
        for req_id in connector_output.finished_recving or ():
            spec = self._loading.pop(req_id, None)
            if spec is None:
                continue
            blocks = spec.block_ids[spec.start_block : spec.end_block]
            if bad and not bad.isdisjoint(blocks):
                continue  # the worker counted it as failed
            self._count("transfer_requests", "received")
            self._count(
                "transfer_tokens", "received", spec.num_tokens - spec.start_block * self.block_size
            )
            self._count("transfer_bytes", "received", len(blocks) * self.bytes_per_block)

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._recv_lookups.pop(req_id, None)
        self._loaded.discard(req_id)
        spec = self._loading.pop(req_id, None)
        if spec is not None:  # finished (aborted) while its KV was on the way
            self._pending_discards.append(spec.transfer_id)
        send = self._sends.pop(req_id, None)
        if send is None or send.spec is None:
            return False, None
        save = send.spec
        kv_bytes = len(save.block_ids) * self.bytes_per_block
        self._count("transfer_requests", "sent")
        self._count("transfer_tokens", "sent", save.num_tokens)
        self._count("transfer_bytes", "sent", kv_bytes)
        return True, {
            "do_remote_prefill": True,
            "transfer_id": save.transfer_id,
            "num_tokens": save.num_tokens,
            "prompt_hash": save.prompt_hash,
            "kv_bytes": kv_bytes,
            "remote_engine_id": self.engine_id,
            "remote_host": send.params.remote_host,
            "remote_port": send.params.remote_port,
        }

    def get_kv_connector_stats(self) -> dict[str, dict[str, float]] | None:
        stats = {metric: dict(values) for metric, values in self._stats.items()}
        with _TOTALS_LOCK:
            for metric, values in _WORKER_TOTALS.get(self.engine_id, {}).items():
                stats.setdefault(metric, {}).update(values)
        return stats or None

    # ---- worker side -----------------------------------------------------------------------

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
            if save.stop_after_layers is not None and index >= save.stop_after_layers:
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
            )
            self._sender(save.address).send_layer(save.req_id, header, blocks)

    def _sender(self, address: str) -> PeerSender:
        sender = self._senders.get(address)
        if sender is None:
            import zmq

            from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
                PeerSender,
            )

            if self._zmq_context is None:
                self._zmq_context = zmq.Context()
            sender = PeerSender(self._zmq_context, address, self.send_timeout_s)
            self._senders[address] = sender
        return sender

    def wait_for_save(self) -> None:
        return None  # sends go on in the background; get_finished reports them

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for sender in self._senders.values():
            for req_id, ok, _num_bytes, seconds in sender.take_done():
                self._in_flight.discard(req_id)
                if ok:
                    _add_total(self.engine_id, "transfer_seconds", "sent", seconds)
        self._finished |= finished_req_ids
        sending = {r for r in self._finished if r not in self._in_flight}
        self._finished -= sending
        return sending or None, self._poll_recvs(finished_req_ids) or None

    def _poll_recvs(self, finished_req_ids: set[str]) -> set[str]:
        """Copies every arrived transfer into its blocks; returns the requests whose load
        ended (well or not: failures are in the load errors)."""
        receiver = self._receiver
        done: set[str] = set()
        if receiver is None:
            return done
        now = time.monotonic()
        for req_id, (spec, deadline) in list(self._recvs.items()):
            if req_id in finished_req_ids:  # aborted: its blocks may be someone else's now
                receiver.discard(spec.transfer_id)
                del self._recvs[req_id]
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
                _add_total(self.engine_id, "transfer_requests", "failed", 1.0)
                self._load_errors.update(spec.block_ids[spec.start_block : spec.end_block])
            del self._recvs[req_id]
            done.add(req_id)
        return done

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
        _add_total(self.engine_id, "transfer_seconds", "received", seconds)
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

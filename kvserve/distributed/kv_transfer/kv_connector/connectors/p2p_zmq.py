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

Tensor parallelism: producer and consumer have the same TP size; producer rank r sends its
own KV heads to consumer rank r, listening at kv_port + r (the params carry the
producer's tp_size; a consumer of another TP size refuses the transfer and computes the
prompt). The scheduler hears from one rank only, so the ranks agree each step (one gloo
all-gather, in steps with transfers pending) on which transfers every rank has ended:
a request is finished_recving / finished_sending once it is on every rank, and a load
that failed on any rank is a load error on all, recomputed everywhere. Pipeline
parallelism is refused.

One KV cache group of full attention. Per request, "fault_stop_after_layers": N makes the
producer send only its first N layers, on every rank or only on TP rank
"fault_tp_rank" (fault injection for tests: the consumer then sees a transfer that never
completes).
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
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
from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_worker import (
    LoadSpec,
    P2pMetadata,
    P2pWorkerSide,
    SaveSpec,
)
from kvserve.distributed.kv_transfer.kv_connector.utils import (
    follow_scheduled_blocks,
    worker_totals,
)
from kvserve.kvcache.integrity import kv_authenticator, read_secret
from kvserve.utils.zmq_curve import socket_security

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

MAX_CLAIMED = 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Send:
    """Scheduler side: a producer request, followed until its prompt is sent."""

    params: SendParams
    transfer_id: str
    prompt_token_ids: list[int]
    block_ids: list[list[int]]
    stop_after_layers: int | None
    stop_tp_rank: int | None  # the one rank that stops (None: every rank)
    spec: SaveSpec | None = None  # set once the save is planned


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class P2pZmqConnector(P2pWorkerSide, KVConnectorBase_V1):
    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        parallel = config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config.kv_connector 'P2pZmqConnector' does not support "
                f"pipeline_parallel_size {parallel.pipeline_parallel_size} (tensor "
                "parallelism only: each TP rank sends its KV heads to the consumer's same rank)"
            )

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        transfer = self.kv_transfer_config
        self.check_parallel_config(config)
        self.tp_size = config.parallel_config.tensor_parallel_size
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
        auth = kv_authenticator(
            config.kv_security_config,
            f"P2P KV transfer over the network ({transfer.kv_role}, {self.kv_host})",
        )
        security = socket_security(read_secret(config.kv_security_config))
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
        self._ended_loads: dict[str, LoadSpec] = {}  # ended while loading, until the output
        self._loaded: set[str] = set()  # loaded once: a preempted request recomputes
        # Transfers a request took (the latest ones): the n samples of one request carry
        # the same params, and only the first loads; the others compute the prompt.
        self._claimed: OrderedDict[str, None] = OrderedDict()
        self._pending_loads: list[LoadSpec] = []
        self._pending_discards: list[str] = []
        self._stats: dict[str, dict[str, float]] = {}
        # Worker side (p2p_worker.py); only a consumer's worker listens, rank r at port + r.
        receiver = None
        tp_rank = 0
        if role == KVConnectorRole.WORKER and self.tp_size > 1:
            from kvserve.distributed.parallel_state import get_tp_group

            tp_rank = get_tp_group().rank_in_group
        if role == KVConnectorRole.WORKER and transfer.is_kv_consumer:
            from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
                Receiver,
            )

            assert isinstance(port, int)
            receiver = Receiver(
                f"tcp://{self.kv_host}:{port + tp_rank}",
                int(transfer.get_from_extra_config("max_buffer_bytes", 1 << 30)),
                float(transfer.get_from_extra_config("buffer_ttl_s", 120.0)),
                tp_rank,
                self.tp_size,
                auth,
                security,
            )
        self._init_worker_side(receiver, tp_rank, self.tp_size, auth, security)

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
        if params.transfer_id in self._claimed:
            return 0, False
        if params.tp_size != self.tp_size:
            logger.warning(
                "request %s: kv_transfer_params.tp_size %d (the producer's "
                "tensor_parallel_size) != this engine's tensor_parallel_size %d: its ranks "
                "hold other KV heads; computing the prompt here",
                req_id, params.tp_size, self.tp_size,
            )  # fmt: skip
            self._count("transfer_requests", "refused")
            self._loaded.add(req_id)
            self._pending_discards.append(params.transfer_id)
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
            self._claimed[recv.transfer_id] = None
            if len(self._claimed) > MAX_CLAIMED:
                self._claimed.popitem(last=False)
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
            stop_rank = params.get("fault_tp_rank")
            self._sends[req_id] = _Send(
                send,
                # Unique per request even when several share the params (a batch, n > 1).
                f"{send.transfer_id or self.engine_id}-{req_id}-{uuid.uuid4().hex[:8]}",
                list(request.prompt_token_ids),
                block_ids,
                _int_or_none(stop),
                _int_or_none(stop_rank),
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
                send.params.remote_host,
                send.params.remote_port,
                send.block_ids[0][: _cdiv(n, self.block_size)],
                n,
                prompt_hash(send.prompt_token_ids[:n]),
                send.stop_after_layers,
                send.stop_tp_rank,
            )
            meta.saves.append(send.spec)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        bad = connector_output.invalid_block_ids
        # Loads of requests the scheduler just ended (policy "fail" ends one before this
        # call, in the same output that reports its load's failure).
        ended, self._ended_loads = self._ended_loads, {}
        for req_id in connector_output.finished_recving or ():
            spec = self._loading.pop(req_id, None) or ended.get(req_id)
            if spec is None:
                continue
            blocks = spec.block_ids[spec.start_block : spec.end_block]
            if bad and not bad.isdisjoint(blocks):
                # Counted here, not by the workers: under TP they run in other processes.
                self._count("transfer_requests", "failed")
                continue
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
        if spec is not None:  # finished (aborted, failed) while its KV was on the way
            self._pending_discards.append(spec.transfer_id)
            self._ended_loads[req_id] = spec
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
            "tp_size": self.tp_size,
        }

    def get_kv_connector_stats(self) -> dict[str, dict[str, float]] | None:
        stats = {metric: dict(values) for metric, values in self._stats.items()}
        for metric, values in worker_totals(self.engine_id).items():
            stats.setdefault(metric, {}).update(values)
        return stats or None

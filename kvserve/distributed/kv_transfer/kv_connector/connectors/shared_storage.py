"""SharedStorageConnector: the reference connector, KV as safetensors files in a directory.

Layout: ``<shared_storage_path>/<key>/<layer_name>.safetensors``, one tensor "kv" of shape
[2, num_blocks, block_size, kv_heads, head_size] per layer holding a prompt's full blocks,
read through the block table of the layer's KV cache group. A sliding-window layer's
entry is valid over the last window of the prefix only (older blocks were freed before
the save, and a reader never attends to them either); a save is skipped when even that
part is no longer in place.
``key`` is a sha256 chained over the token ids block by block (seeded with the format,
model, block size and cache salt), so any engine process computes the same key for the
same prefix, and the key of every block-aligned prefix comes out of one pass.

Under tensor parallelism each rank holds its own KV heads and stores them in its own entry,
``<key>.tp<rank>-of-<size>``; under pipeline parallelism each stage holds its own layers,
``<key>.pp<stage>-of-<stages>`` (both: ``<key>.tp<r>-of-<n>.pp<s>-of-<m>``). A prefix is
stored once every rank's entry is, and a rank whose load fails makes every rank report
the blocks (one all-reduce over the whole world per loading step): the scheduler hears
from one rank (the last stage's first TP rank) and recomputes them everywhere.

A directory appears only complete: layers are written into a hidden temp directory and
renamed into place by wait_for_save, so a reader in another process never sees half an
entry. A later request whose tokens start with a stored prefix loads it (the longest one),
layer by layer in wait_for_layer_load. A missing, truncated or mismatched file is a load
error reported through get_block_ids_with_load_errors, never a crash.

Other processes and hosts write the directory, so each layer file carries a MAC (metadata
"mac"; kvserve.kvcache.integrity) over its entry and layer name, its format, block size,
dtype and shape, and its bytes: a file that fails it (forged, or a valid one copied under
another prefix's name) is a load error too, counted as kv_connector_auth_failures. Without
a KV secret the connector refuses to start unless unauthenticated KV is allowed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.distributed.kv_transfer.kv_connector.base import (
    ConnectorBlocks,
    ConnectorRequest,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvserve.distributed.kv_transfer.kv_connector.utils import (
    add_worker_total,
    check_connector_layout,
    follow_scheduled_blocks,
    layer_to_group,
    worker_totals,
)
from kvserve.kvcache.integrity import kv_authenticator

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.distributed.parallel_state import GroupCoordinator
    from kvserve.forward_context import ForwardContext
    from kvserve.protocol.kv_cache_interface import KVCacheConfig
    from kvserve.protocol.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

FORMAT = "kvserve-shared-storage-v1"


def prefix_keys(token_ids: list[int], block_size: int, salt: str) -> Iterator[str]:
    """The key of each full-block prefix of token_ids, shortest first (deterministic)."""
    hasher = hashlib.sha256(salt.encode())
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        hasher.update(struct.pack(f"<{block_size}q", *block))
        yield hasher.copy().hexdigest()


@dataclass
class LoadSpec:
    req_id: str
    key: str
    # Blocks [start_block, end_block) of the stored prefix go into block_ids (per group).
    start_block: int
    end_block: int
    block_ids: list[list[int]]


@dataclass
class SaveSpec:
    req_id: str
    key: str
    # The request's blocks holding its prompt's full blocks, in order, per group.
    block_ids: list[list[int]]


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side view of a running request, enough to plan its save."""

    prompt_token_ids: list[int]
    salt: str
    block_ids: list[list[int]]


class SharedStorageConnector(KVConnectorBase_V1):
    @classmethod
    def check_parallel_config(cls, config: EngineConfig) -> None:
        return None  # any TP x PP: each rank stores its own heads of its own layers

    def __init__(
        self,
        config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        path = self.kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not path:
            raise ValueError(
                "SharedStorageConnector needs kv_connector_extra_config['shared_storage_path']"
            )
        self._windows = check_connector_layout(kv_cache_config, "SharedStorageConnector", 0)
        self._layer_group = layer_to_group(kv_cache_config)
        self.root = os.path.abspath(str(path))
        self._auth = kv_authenticator(config.kv_security_config, f"the shared storage {self.root}")
        self._engine_id = str(self.kv_transfer_config.engine_id)
        os.makedirs(self.root, exist_ok=True)
        self.block_size = config.cache_config.block_size
        parallel = config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        # The whole world agrees on failed loads: the scheduler hears from one rank only.
        self._world: GroupCoordinator | None = None
        self.tp_rank = self.pp_rank = 0
        if role == KVConnectorRole.WORKER and parallel.world_size > 1:
            from kvserve.distributed.parallel_state import (
                get_pp_group,
                get_tp_group,
                get_world_group,
            )

            self._world = get_world_group()
            self.tp_rank = get_tp_group().rank_in_group
            self.pp_rank = get_pp_group().rank_in_group
        self._salt = f"{FORMAT}|{config.model_config.resolved.name}|{self.block_size}"
        # Scheduler side.
        self._lookups: dict[str, tuple[str, int]] = {}  # req_id -> (key, num tokens stored)
        self._pending_loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads_to_do: list[LoadSpec] = []
        self._failed_loads: set[str] = set()  # req ids whose load failed in this step
        self._load_errors: set[int] = set()
        self._save_dirs: dict[str, str] = {}  # key -> temp dir being written in this step

    def _request_salt(self, cache_salt: str | None) -> str:
        return self._salt if cache_salt is None else f"{self._salt}|{cache_salt}"

    def _entry_dir(self, key: str, rank: tuple[int, int] | None = None) -> str:
        """Where the (tp rank, pp stage) ``rank``'s part of an entry lives (this worker's
        by default). One rank keeps the plain name, TP alone the TP-only one."""
        tp_rank, pp_rank = (self.tp_rank, self.pp_rank) if rank is None else rank
        name = key
        if self.tp_size > 1:
            name += f".tp{tp_rank}-of-{self.tp_size}"
        if self.pp_size > 1:
            name += f".pp{pp_rank}-of-{self.pp_size}"
        return os.path.join(self.root, name)

    def _stored(self, key: str) -> bool:
        """Whether every rank's part of the entry is in place."""
        return all(
            os.path.isdir(self._entry_dir(key, (tp_rank, pp_rank)))
            for tp_rank in range(self.tp_size)
            for pp_rank in range(self.pp_size)
        )

    def _layer_file(self, entry_dir: str, layer_name: str) -> str:
        return os.path.join(entry_dir, layer_name.replace(os.sep, "_") + ".safetensors")

    def _mac_key(self, key: str, layer_name: str) -> str:
        """What a layer file's MAC binds it to: its entry (prefix and rank) and layer."""
        return f"{os.path.basename(self._entry_dir(key))}/{layer_name}"

    def _mac_header(self, kv: torch.Tensor) -> bytes:
        return f"{FORMAT}|{self.block_size}|{kv.dtype}|{list(kv.shape)}".encode()

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._lookups.pop(request.request_id, None)
        if not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        tokens = request.all_token_ids
        # The last token is always computed: its logits give the next token.
        max_blocks = (len(tokens) - 1) // self.block_size
        keys = list(
            prefix_keys(
                tokens[: max_blocks * self.block_size],
                self.block_size,
                self._request_salt(request.cache_salt),
            )
        )
        for num_blocks in range(max_blocks, num_computed_tokens // self.block_size, -1):
            key = keys[num_blocks - 1]
            if self._stored(key):
                num_tokens = num_blocks * self.block_size
                self._lookups[request.request_id] = (key, num_tokens)
                return num_tokens - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: ConnectorBlocks, num_external_tokens: int
    ) -> None:
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._tracked[request.request_id] = _Tracked(
            list(request.prompt_token_ids), self._request_salt(request.cache_salt), block_ids
        )
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens <= 0 or lookup is None:
            return
        key, num_tokens = lookup
        start_block = (num_tokens - num_external_tokens) // self.block_size
        end_block = num_tokens // self.block_size
        self._pending_loads.append(
            LoadSpec(
                request.request_id,
                key,
                start_block,
                end_block,
                [ids[start_block:end_block] for ids in block_ids],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SharedStorageConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = follow_scheduled_blocks(scheduler_output, self._tracked)
        if self.kv_transfer_config.is_kv_producer:
            meta.saves = self._plan_saves(scheduled, scheduler_output.num_scheduled_tokens)
        return meta

    def _plan_saves(
        self, scheduled: list[tuple[str, int]], num_new: dict[str, int]
    ) -> list[SaveSpec]:
        """Saves the prompts whose prefill completes in this step, unless already stored."""
        saves: dict[str, SaveSpec] = {}
        for req_id, computed in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            num_prompt = len(tracked.prompt_token_ids)
            if not computed < num_prompt <= computed + num_new.get(req_id, 0):
                continue
            num_blocks = num_prompt // self.block_size
            if num_blocks == 0 or not self._windows_in_place(computed, num_blocks):
                continue
            *_, key = prefix_keys(
                tracked.prompt_token_ids[: num_blocks * self.block_size],
                self.block_size,
                tracked.salt,
            )
            if key not in saves and not self._stored(key):
                saves[key] = SaveSpec(req_id, key, [ids[:num_blocks] for ids in tracked.block_ids])
        return list(saves.values())

    def _windows_in_place(self, num_computed: int, num_blocks: int) -> bool:
        """Whether every sliding window still holds the last window of the prefix: blocks
        out of view of the step's first query (num_computed) were freed at its start."""
        end = num_blocks * self.block_size
        for window in self._windows:
            freed_upto = max(num_computed - window + 1, 0) // self.block_size * self.block_size
            if freed_upto > max(end - window + 1, 0):
                return False
        return True

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SharedStorageConnectorMetadata)
        # Layer by layer: each attention layer pulls its own file in wait_for_layer_load.
        self._loads_to_do = list(meta.loads)
        self._failed_loads = set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        for spec in self._loads_to_do:
            if spec.req_id not in self._failed_loads:
                self._load_layer(spec, layer_name)

    def _load_layer(self, spec: LoadSpec, layer_name: str) -> bool:
        """Copies one layer of a stored prefix into the cache; on any fault records the
        request's blocks as load errors and returns False."""
        cache = self._kv_caches[layer_name]
        path = self._layer_file(self._entry_dir(spec.key), layer_name)
        try:
            kv, mac = _read_layer(path)
            if not self._auth.verify(
                self._mac_key(spec.key, layer_name),
                self._mac_header(kv),
                _tensor_bytes(kv),
                bytes.fromhex(mac),
                f"the shared storage {self.root}",
            ):
                add_worker_total(self._engine_id, "auth_failures", "shared_storage", 1)
                raise ValueError("the file failed authentication")
            # K and V (2) or MLA's one latent (1), then blocks, then the page.
            expected = (cache.shape[0], kv.shape[1], *cache.shape[2:])
            if tuple(kv.shape) != expected or kv.shape[1] < spec.end_block:
                raise ValueError(
                    f"shape {tuple(kv.shape)} does not fit the cache {tuple(cache.shape)}"
                )
            if kv.dtype != cache.dtype:
                raise ValueError(f"dtype {kv.dtype} != cache dtype {cache.dtype}")
            import torch

            block_ids = spec.block_ids[self._layer_group.get(layer_name, 0)]
            ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
            cache[:, ids] = kv[:, spec.start_block : spec.end_block].to(cache.device)
            return True
        except Exception as exc:  # any unreadable entry is a load error, not a crash
            logger.warning("KV load of %s for %s failed: %s", path, spec.req_id, exc)
            self._failed_loads.add(spec.req_id)
            for group_ids in spec.block_ids:
                self._load_errors.update(group_ids)
            return False

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SharedStorageConnectorMetadata)
        for spec in meta.saves:
            temp_dir = self._save_dirs.get(spec.key)
            if temp_dir is None:
                temp_dir = tempfile.mkdtemp(prefix=f".tmp-{spec.key[:16]}-", dir=self.root)
                self._save_dirs[spec.key] = temp_dir
            import torch
            from safetensors.torch import save_file

            block_ids = spec.block_ids[self._layer_group.get(layer_name, 0)]
            ids = torch.tensor(block_ids, dtype=torch.long, device=kv_layer.device)
            blocks = kv_layer[:, ids].to("cpu").contiguous()
            metadata = {
                "format": FORMAT,
                "block_size": str(self.block_size),
                "mac": self._auth.tag(
                    self._mac_key(spec.key, layer_name),
                    self._mac_header(blocks),
                    _tensor_bytes(blocks),
                ).hex(),
            }
            save_file({"kv": blocks}, self._layer_file(temp_dir, layer_name), metadata)

    def wait_for_save(self) -> None:
        # Publish each entry with one rename: readers see all of it or nothing.
        for key, temp_dir in self._save_dirs.items():
            try:
                os.rename(temp_dir, self._entry_dir(key))
            except OSError:  # another writer published the same prefix first
                shutil.rmtree(temp_dir, ignore_errors=True)
        self._save_dirs = {}

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._world is not None and self._loads_to_do:
            self._agree_on_failed_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _agree_on_failed_loads(self) -> None:
        """A load that failed on any rank failed on all: the scheduler hears from one rank
        only. Every rank follows the same metadata (every stage runs the batches in the
        same order, batch queue or not), so the all-reduce always matches."""
        import torch

        assert self._world is not None
        failed = torch.tensor(
            [spec.req_id in self._failed_loads for spec in self._loads_to_do], dtype=torch.int64
        )
        self._world.all_reduce(failed)
        for spec, count in zip(self._loads_to_do, failed.tolist(), strict=True):
            if count:
                self._failed_loads.add(spec.req_id)
                for group_ids in spec.block_ids:
                    self._load_errors.update(group_ids)

    def get_kv_connector_stats(self) -> dict[str, dict[str, float]] | None:
        return worker_totals(self._engine_id) or None

    def shutdown(self) -> None:
        for temp_dir in self._save_dirs.values():
            shutil.rmtree(temp_dir, ignore_errors=True)
        self._save_dirs = {}


def _read_layer(path: str) -> tuple[torch.Tensor, str]:
    """The "kv" tensor of one layer file and its MAC (hex); raises on a missing, foreign
    or damaged file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format={metadata.get('format')!r})")
        return f.get_tensor("kv"), metadata.get("mac", "")


def _tensor_bytes(kv: torch.Tensor) -> memoryview:
    import torch

    return memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy().data).cast("B")

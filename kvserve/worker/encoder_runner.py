"""The model runner's side of multimodal models (vLLM's encoder cache and embedding merge),
as a component it holds: ``EncoderRunner`` is the no-op form for a text model,
``MultiModalEncoderRunner`` the one for a model with a vision tower.

Each step: drop the outputs the scheduler's EncoderCacheManager evicted; encode the items
it scheduled (or load them through the encoder cache connector), keyed by content hash;
embed the step's tokens and overwrite the placeholder positions with the slices of the
items' outputs that fall in the step; and, for models whose image tokens attend both
ways, let each prefill chunk's image tokens see the later tokens of the same image.

An item the step needs but the cache lacks (e.g. after a failed step) is encoded on the
spot from the request's own data, so the embeddings never depend on the scheduler and
the runner agreeing on every eviction.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.distributed.ec_transfer.ec_connector import ECConnector
from kvserve.protocol.mm_inputs import MultiModalFeatureSpec
from kvserve.protocol.runner_output import EncoderRunStats
from kvserve.protocol.scheduler_output import SchedulerOutput
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.input_preparation import StepInputs
from kvserve.worker.request_states import RequestStates

logger = logging.getLogger(__name__)


def _embed_index(feature: MultiModalFeatureSpec) -> np.ndarray | None:
    """Per position of the range: its row in the item's output (-1: not an embedding)."""
    is_embed = feature.mm_position.is_embed
    if is_embed is None:
        return None
    mask = np.asarray(is_embed, dtype=bool)
    return np.where(mask, np.cumsum(mask) - 1, -1)


def _block_ids(feature: MultiModalFeatureSpec) -> np.ndarray:
    """Per position of the range: which run of embeddings (one image or crop) it is in;
    -1 for the text between runs. Tokens of one run attend to each other both ways."""
    is_embed = feature.mm_position.is_embed
    if is_embed is None:
        return np.zeros(feature.mm_position.length, dtype=np.int64)
    mask = np.asarray(is_embed, dtype=bool)
    starts = mask & ~np.concatenate(([False], mask[:-1]))
    return np.where(mask, np.cumsum(starts) - 1, -1)


class EncoderRunner:
    """A text model: no encoder inputs, the model embeds its own ids."""

    def set_model(self, model: Any) -> None:
        pass

    def execute_mm_encoder(
        self, scheduler_output: SchedulerOutput, requests: RequestStates
    ) -> None:
        pass

    def model_kwargs(
        self, batch: InputBatch, inputs: StepInputs, attn_metadata: Any
    ) -> dict[str, Any]:
        """Extra keyword arguments of the step's forward."""
        return {}

    def take_encoder_stats(self) -> EncoderRunStats | None:
        return None

    def shutdown(self) -> None:
        pass


class MultiModalEncoderRunner(EncoderRunner):
    """Owns the encoder cache (content hash -> the item's embeddings), the encoder cache
    connector and the encoder's counters."""

    # The processed input an item carries (feature.data), the encoder's argument.
    input_key = "pixel_values"

    def __init__(
        self, device: torch.device, bidirectional_mm: bool, ec_connector: ECConnector | None
    ) -> None:
        self.device = device
        self.bidirectional_mm = bidirectional_mm
        self.ec_connector = ec_connector
        self.model: Any = None
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self._encoder_stats = EncoderRunStats()

    def set_model(self, model: Any) -> None:
        self.model = model

    def _encoder_output(self, feature: MultiModalFeatureSpec, keep: bool = True) -> torch.Tensor:
        """The item's output: cached, loaded (EC connector) or encoded now. ``keep``: cache
        it (items the scheduler scheduled; it tells when to drop them)."""
        out = self.encoder_cache.get(feature.identifier)
        if out is not None:
            return out
        if self.ec_connector is not None:
            out = self.ec_connector.load(feature.identifier, self.device)
            if out is not None:
                self._encoder_stats.ec_connector_loads += 1
        if out is None:
            if feature.data is None or self.input_key not in feature.data:
                raise RuntimeError(f"item {feature.identifier[:16]} has no {self.input_key}")
            pixels = torch.from_numpy(feature.data[self.input_key].to_numpy().copy())
            out = self.model.embed_multimodal(pixels.to(self.device))
            self._encoder_stats.vision_tower_runs += 1
            if self.ec_connector is not None:
                self.ec_connector.save(feature.identifier, out)
                self._encoder_stats.ec_connector_saves += 1
        if out.shape[0] != feature.mm_position.num_embeds:
            raise RuntimeError(
                f"item {feature.identifier[:16]}: {out.shape[0]} embeddings for "
                f"{feature.mm_position.num_embeds} placeholder positions"
            )
        if keep:
            self.encoder_cache[feature.identifier] = out
        return out

    def execute_mm_encoder(
        self, scheduler_output: SchedulerOutput, requests: RequestStates
    ) -> None:
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            state = requests[req_id]
            for i in input_ids:
                self._encoder_output(state.mm_features[i])

    def take_encoder_stats(self) -> EncoderRunStats | None:
        stats, self._encoder_stats = self._encoder_stats, EncoderRunStats()
        return stats

    def model_kwargs(
        self, batch: InputBatch, inputs: StepInputs, attn_metadata: Any
    ) -> dict[str, Any]:
        self.add_mm_bidirectional_masks(batch, inputs, attn_metadata)
        return {"inputs_embeds": self.mm_inputs_embeds(batch, inputs)}

    def mm_inputs_embeds(self, batch: InputBatch, inputs: StepInputs) -> torch.Tensor | None:
        """The step's input embeddings with the image embeddings merged (None for a step
        without images, which embeds its ids itself)."""
        embeds: torch.Tensor | None = None
        starts = batch.num_computed_tokens_cpu
        for row, state in enumerate(batch.requests[: batch.num_reqs]):
            if state is None or not state.mm_features:
                continue
            start, n = int(starts[row]), int(inputs.num_scheduled_tokens[row])
            token0 = int(inputs.query_start_loc_np[row])
            for feature in state.mm_features:
                pos = feature.mm_position
                if not pos.overlaps(start, start + n):
                    continue
                if embeds is None:
                    embeds = self.model.embed_input_ids(inputs.input_ids)
                # Not kept when missing: only the scheduler's items have a known lifetime.
                out = self._encoder_output(feature, keep=False)
                lo, hi = max(start, pos.offset), min(start + n, pos.end)
                index = _embed_index(feature)
                if index is None:
                    rows = slice(lo - pos.offset, hi - pos.offset)
                    embeds[token0 + lo - start : token0 + hi - start] = out[rows].to(embeds.dtype)
                    continue
                rel = np.arange(lo - pos.offset, hi - pos.offset)
                keep = rel[index[rel] >= 0]
                targets = torch.from_numpy(token0 + keep + pos.offset - start).to(self.device)
                embeds[targets] = out[torch.from_numpy(index[keep]).to(self.device)].to(
                    embeds.dtype
                )
        return embeds

    def add_mm_bidirectional_masks(
        self, batch: InputBatch, inputs: StepInputs, attn_metadata: Any
    ) -> None:
        """Image tokens of a prefill chunk may see the later tokens of their own image
        (HF's token_type_ids block mask); set as each chunk's ``extra_visible``."""
        if not self.bidirectional_mm:
            return
        metadatas = attn_metadata.values() if isinstance(attn_metadata, dict) else [attn_metadata]
        chunks_by_start: dict[int, list[Any]] = {}
        for md in {id(m): m for m in metadatas}.values():
            for chunk in getattr(md, "prefills", ()):
                chunks_by_start.setdefault(chunk.token_start, []).append(chunk)
        starts = batch.num_computed_tokens_cpu
        for row, state in enumerate(batch.requests[: batch.num_reqs]):
            if state is None or not state.mm_features:
                continue
            chunks = chunks_by_start.get(int(inputs.query_start_loc_np[row]))
            if not chunks:
                continue
            start, n = int(starts[row]), int(inputs.num_scheduled_tokens[row])
            seq_len = start + n
            groups = np.full(seq_len, -1, dtype=np.int64)
            next_group = 0
            for feature in state.mm_features:
                pos = feature.mm_position
                if pos.offset >= seq_len or not pos.overlaps(start, seq_len):
                    continue
                ids = _block_ids(feature)
                ids = np.where(ids >= 0, ids + next_group, -1)
                next_group = int(ids.max()) + 1
                end = min(pos.end, seq_len)
                groups[pos.offset : end] = ids[: end - pos.offset]
            if next_group == 0:
                continue
            g = torch.from_numpy(groups).to(self.device)
            q = g[start:seq_len]
            q_pos = torch.arange(start, seq_len, device=self.device)
            k_pos = torch.arange(seq_len, device=self.device)
            extra = (
                (q[:, None] == g[None, :]) & (q[:, None] >= 0) & (k_pos[None, :] > q_pos[:, None])
            )
            for chunk in chunks:
                chunk.extra_visible = extra

    def shutdown(self) -> None:
        if self.ec_connector is not None:
            self.ec_connector.close()


class CrossAttentionEncoderRunner(MultiModalEncoderRunner):
    """An encoder-decoder model's (Whisper): the encoder turns an item's log-mel features
    into its output, which the decoder's cross-attention layers turn into K/V in the
    request's first step (``encoder_outputs``, one per row that starts, in row order:
    the order ``CrossAttentionMetadata.write_rows`` takes). The decoder embeds its own
    token ids."""

    input_key = "input_features"

    def model_kwargs(
        self, batch: InputBatch, inputs: StepInputs, attn_metadata: Any
    ) -> dict[str, Any]:
        outputs: list[torch.Tensor] = []
        starts = batch.num_computed_tokens_cpu
        for row, state in enumerate(batch.requests[: batch.num_reqs]):
            if state is None or int(starts[row]) != 0 or not inputs.num_scheduled_tokens[row]:
                continue
            if len(state.mm_features) != 1:
                raise RuntimeError(
                    f"{state.req_id}: an encoder-decoder request needs one encoder input, "
                    f"got {len(state.mm_features)}"
                )
            outputs.append(self._encoder_output(state.mm_features[0], keep=False))
        return {"encoder_outputs": outputs}


def make_encoder_runner(config: EngineConfig, device: torch.device) -> EncoderRunner:
    mm_arch = config.model_config.arch.multimodal
    if mm_arch is None:
        return EncoderRunner()
    ec = config.multimodal_config.ec_transfer_config
    ec_connector = None
    if ec is not None:
        name = config.model_config.served_model_name or str(config.model_config.model)
        ec_connector = ECConnector(ec, name, config.kv_security_config)
    if mm_arch.encoder_decoder:
        return CrossAttentionEncoderRunner(device, False, ec_connector)
    if mm_arch.bidirectional_items:
        from kvserve.attention.backends.registry import get_attn_backend

        backend = get_attn_backend(device).get_name()
        if backend != "CPU_ATTN":
            # Its prefill chunks carry the image-group mask; another backend's would stay
            # causal and give other tokens than HF's, silently.
            raise ValueError(
                f"{config.model_config.arch.architecture}'s image tokens attend "
                f"bidirectionally, which only the CPU_ATTN backend implements, not {backend}: "
                "set KVSERVE_ATTENTION_BACKEND=CPU_ATTN"
            )
    return MultiModalEncoderRunner(device, mm_arch.bidirectional_items, ec_connector)

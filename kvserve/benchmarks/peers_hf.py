"""HF transformers static batching on the same GGUF weights, for `kvserve bench peers`.

Static batching: requests (sorted by prompt length, which gives HF its least padding) are
cut into batches of B, left-padded, and every batch generates the longest output of its
members, with min_new_tokens so EOS never stops it early. Only each request's own output
length counts as output; the rest of the batch's tokens are the cost of static batching.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from tqdm.auto import tqdm

from kvserve.benchmarks.peers_workloads import EngineResult, PeerRequest


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF's metadata once for the tokenizer, once for the config
    and once for the weights (~7 s each for SmolLM2's vocabulary on these machines, ~20 s
    for Gemma's 262k tokens), and builds the same tensor-name map once per module of the
    model (~400 times, 8 s). Both are pure: the reader is a read-only memory map, the map
    a function of the architecture and the layer count, so here each is made once.

    The parse itself slices the memmap once per part of every field (two per token of the
    vocabulary), and numpy's memmap subclass makes each slice cost ~3x a plain array's; the
    reader here slices a plain-array view of the same map, so every field and tensor holds
    the same bytes, dtypes and shapes (~8 s less CPU for Gemma's 262k tokens)."""
    import gguf
    import numpy as np

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    class PlainArrayReader(real_reader):  # type: ignore[misc,valid-type]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if "_plain" not in self.__dict__:
                self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = self._plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    def shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return real_reader(path, *args, **kwargs)
        if str(path) not in readers:
            readers[str(path)] = PlainArrayReader(path)
        return readers[str(path)]

    with (
        mock.patch.object(gguf, "GGUFReader", shared_reader),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(real_name_map)),
    ):
        yield


class HFPeer:
    """One float32 HF model, reused for every workload and batch size."""

    def __init__(self, gguf_path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        path = Path(gguf_path)
        with one_gguf_parse():
            self.model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            ).eval()
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.pad_id = int(self.model.generation_config.pad_token_id or eos_ids[0] or 0)

    def _run_batch(self, batch: list[PeerRequest]) -> int:
        """Generates one left-padded batch; returns the tokens it generated (incl. waste)."""
        import torch

        width = max(len(r.prompt_token_ids) for r in batch)
        new_tokens = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        return int(out.shape[0] * (out.shape[1] - width))

    def run(
        self, workload: str, requests: list[PeerRequest], batch_size: int, progress: bool
    ) -> EngineResult:
        ordered = sorted(requests, key=lambda r: len(r.prompt_token_ids))
        batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
        self._run_batch([PeerRequest(requests[0].prompt_token_ids[:8], 2)])  # warm-up
        generated = 0
        start = time.perf_counter()
        for batch in tqdm(batches, desc=f"hf B={batch_size} ({workload})", disable=not progress):
            generated += self._run_batch(batch)
        elapsed = time.perf_counter() - start
        return EngineResult(
            engine="hf",
            workload=workload,
            elapsed_s=elapsed,
            prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
            output_tokens=sum(r.output_len for r in requests),
            config=f"static batch {batch_size}",
            extra={"generated_tokens_incl_padding_waste": generated},
        )


def run_hf(
    gguf_path: str,
    workload: str,
    requests: list[PeerRequest],
    batch_sizes: list[int],
    progress: bool,
    peer: HFPeer | None = None,
) -> tuple[EngineResult, list[EngineResult]]:
    """HF's best static batch size among batch_sizes, and every try (for the JSON)."""
    peer = peer or HFPeer(gguf_path)
    # A batch size above the request count is the same run as the request count.
    sizes = sorted({min(b, len(requests)) for b in batch_sizes})
    tries = [peer.run(workload, requests, b, progress) for b in sizes]
    return max(tries, key=lambda r: r.output_tok_s), tries

"""HF transformers as the correctness reference, on the same GGUF weights, plus shared checks."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from kvserve.benchmarks.peers_hf import one_gguf_parse
from kvserve.benchmarks.quant_accuracy import teacher_forced_agreement
from kvserve.transformers_utils.gguf_reader import file_identity
from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.transformers_utils.tokenizer_cache import cache_root


class HFReference:
    """Greedy decoding and log-softmax from transformers' own GGUF loader, in float32.

    The model and the tokenizer are built on first use: greedy results usually come
    from the on-disk store (``_TokenStore``), which the other xdist worker or an
    earlier run filled, and most callers never need HF's tokenizer."""

    def __init__(self) -> None:
        self.gguf = Path(resolve_model(None).path)
        self._greedy_cache: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._store = _TokenStore(self.gguf)
        # Prompt (less its last token) -> its KV cache, oldest first.
        self._prefix_kv: dict[tuple[int, ...], Any] = {}

    @functools.cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        with one_gguf_parse():
            return AutoTokenizer.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name)

    @functools.cached_property
    def model(self) -> Any:
        model = hf_float32_model(self.gguf)
        # Callers run the causal LM, its decoder alone (embeddings), or the decoder
        # under a wrapper that calls forward() directly (peft): both on one thread.
        on_one_thread(model, model.model)
        return model

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Exactly max_tokens argmax tokens (EOS does not stop it, like ignore_eos=True)."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._greedy_cache:
            self._greedy_cache[key] = self.stored_tokens(
                __file__,
                {"greedy": prompt_ids, "max_tokens": max_tokens},
                lambda: self._compute_greedy(prompt_ids, max_tokens),
            )
        return list(self._greedy_cache[key])

    def stored_tokens(
        self, source: str, inputs: dict[str, Any], compute: Callable[[], list[int]]
    ) -> list[int]:
        """``compute()``'s tokens, a function of this model, of ``inputs`` and of the code
        in the file ``source`` alone, from the store when an earlier call (in this run's
        other worker or an earlier run) computed them."""
        return self._store.get_or_compute(source, inputs, compute)

    @torch.inference_mode()
    def _compute_greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        # logits_to_keep=1: the prompt's other rows would be a vocab-wide matmul each.
        out = self.model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        past, tokens = out.past_key_values, []
        next_id = int(out.logits[0, -1].argmax())
        for _ in range(max_tokens - 1):
            tokens.append(next_id)
            out = self.model(torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_id = int(out.logits[0, -1].argmax())
        tokens.append(next_id)
        return tokens

    @torch.inference_mode()
    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: row i is the distribution of the token after position i."""
        logits = self.model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def continuation_log_softmax(
        self, prompt_ids: list[int], continuation: list[int]
    ) -> torch.Tensor:
        """[len(continuation), vocab]: row i is the distribution of continuation[i] after
        the prompt and continuation[:i] (``log_softmax(prompt + continuation)``'s rows
        len(prompt) - 1 to -1). The prompt's KV (all but its last token) is kept for
        this prompt's next continuation: checks of several lossy paths on one prompt set
        prefill each prompt once, and no row before the continuation reaches the head."""
        if not continuation:
            return torch.empty(0, self.model.config.vocab_size)
        prefix = tuple(prompt_ids[:-1])
        past = self._prefix_kv.pop(prefix, None)
        if past is None and prefix:
            out = self.model(torch.tensor([prefix]), use_cache=True, logits_to_keep=1)
            past = out.past_key_values
        if past is not None:
            self._prefix_kv[prefix] = past
            while len(self._prefix_kv) > _PREFIX_KV_ENTRIES:
                self._prefix_kv.pop(next(iter(self._prefix_kv)))
        # A copy: the forward appends the continuation's KV to the cache it is given.
        rows = [prompt_ids[-1], *continuation[:-1]]
        logits = self.model(
            torch.tensor([rows]),
            past_key_values=copy.deepcopy(past) if past is not None else None,
            use_cache=past is not None,
        ).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


# Prompts whose KV continuation_log_softmax keeps: one prompt set's (tests/prompts.py: 8),
# ~75 MB of SmolLM2's float32 KV at their lengths.
_PREFIX_KV_ENTRIES = 8

# The reference runs on one intra-op thread. Under `pytest -n 2` the two workers already
# keep both cores busy, and torch's default (one OpenMP thread per core) in each of them
# spins against the other: on a loaded 2-core machine that cost 4x the CPU time of one
# thread per greedy continuation, 13x per full forward.
_saved_threads: list[int] = []


def hf_float32_model(gguf: Path) -> Any:
    """transformers' causal LM on ``gguf`` in float32, from its own GGUF loader."""
    from transformers import AutoModelForCausalLM

    with one_gguf_parse():
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()


def on_one_thread(*modules: Any) -> None:
    """Each module's forward on one intra-op thread (see above)."""
    for module in modules:
        module.register_forward_pre_hook(_enter_one_thread)
        module.register_forward_hook(_leave_one_thread, always_call=True)


def _enter_one_thread(module: Any, args: Any) -> None:
    _saved_threads.append(torch.get_num_threads())
    torch.set_num_threads(1)


def _leave_one_thread(module: Any, args: Any, output: Any) -> None:
    torch.set_num_threads(_saved_threads.pop())


class _TokenStore:
    """HF reference tokens on disk, under kvserve's cache directory (pytest's cache in a
    test run): the first xdist worker to need an entry computes it, the other worker and
    later runs read it. An entry's key is everything its tokens follow from: the GGUF
    file's identity, the transformers and torch versions, the source of the file whose
    code computes them, and the inputs. A per-entry file lock makes a second process wait
    for the first's result instead of computing it again; entries are JSON, written to a
    temporary file and renamed into place."""

    def __init__(self, gguf: Path) -> None:
        self.root = cache_root() / "hf_reference"
        self.identity = {
            "gguf": file_identity(str(gguf)),
            "transformers": importlib.metadata.version("transformers"),
            "torch": torch.__version__,
        }

    def get_or_compute(
        self, source: str, inputs: dict[str, Any], compute: Callable[[], list[int]]
    ) -> list[int]:
        code = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        key = json.dumps({**self.identity, "source": code, "inputs": inputs}, sort_keys=True)
        name = hashlib.sha256(key.encode()).hexdigest()
        entry = self.root / f"{name}.json"
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(self.root / f"{name}.lock"):
            tokens = self._read(entry, key)
            if tokens is None:
                tokens = compute()
                fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump({"key": key, "tokens": tokens}, f)
                os.replace(tmp, entry)
        return tokens

    @staticmethod
    def _read(entry: Path, key: str) -> list[int] | None:
        try:
            stored = json.loads(entry.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        tokens = stored.get("tokens")
        if isinstance(tokens, list) and all(type(t) is int for t in tokens):
            return tokens
        return None


@functools.lru_cache(maxsize=1)
def hf_reference() -> HFReference:
    return HFReference()


def assert_no_leak(llm: Any) -> None:
    """Every KV block is back in the free queue and the pool's invariants hold."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    assert scheduler.get_num_unfinished_requests() == 0
    pool = scheduler.kv_cache_manager.block_pool
    pool.check_integrity()
    assert pool.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1


def assert_near_greedy(
    engine: Any, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]]
) -> None:
    """For lossy paths. Free-running, one flip at a near tie changes the rest of a
    continuation, so: every token ``got`` holds is within 0.5 nats of HF's own choice at
    that step, and fed HF's continuation, the engine's top choice is HF's at > 90% of
    steps."""
    reference = hf_reference()
    for prompt, continuation, want in zip(prompts, got, expected, strict=True):
        logprobs = reference.continuation_log_softmax(prompt, continuation)
        chosen = logprobs.gather(1, torch.tensor(continuation)[:, None])[:, 0]
        gap = (logprobs.max(dim=1).values - chosen).max().item()
        assert gap < 0.5, (gap, continuation, want)
    assert teacher_forced_agreement(engine, prompts, expected) > 0.9

"""Sleep mode (vLLM's sleep / wake_up): a worker hands back the memory of its KV cache
(level 1), and of its weights too (level 2), and keeps its process and every tensor
object, so nothing that holds one (attention layers, the KV connector, the draft model)
needs to be told.

On the CPU the pages go back to the OS with madvise(MADV_DONTNEED): the tensors keep
their addresses, the resident memory drops at once, and a page reads as zero when it is
next touched (a fresh page, as a new KV cache's). On a GPU the storages shrink to nothing
and grow back on wake-up (torch's nearest to vLLM's CuMemAllocator unmapping); the
caching allocator returns the memory to the driver on empty_cache.

Level 1 keeps the weights: on the CPU they stay where they are (vLLM offloads them to
host memory, where they already are); on a GPU a host copy goes back on wake-up. Level 2
drops them, and waking the weights loads the model from its files again and copies its
tensors in by name.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvserve.protocol.sleep_mode import KV_CACHE, WEIGHTS, check_sleep_level, check_wake_tags
from kvserve.utils.heap_trim import HeapTrimmer
from kvserve.utils.huge_pages import live_regions

_MADV_DONTNEED = 4  # Linux; the same value on every architecture


def named_module_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What utils/huge_pages.module_tensors walks, with a name per tensor that is the same
    in every instance of the model built the same way (the reload's key)."""
    for module_name, module in model.named_modules():
        if getattr(module, "shared_across_models", False):
            continue  # one instance shared with every model: not this model's to drop
        prefix = f"{module_name}." if module_name else ""
        for name, tensor in module.named_parameters(prefix=module_name, recurse=False):
            yield name, tensor
        for name, tensor in module.named_buffers(prefix=module_name, recurse=False):
            yield name, tensor
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                yield prefix + attr, value
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    item = getattr(value, f.name)
                    if isinstance(item, torch.Tensor):
                        yield f"{prefix}{attr}.{f.name}", item


@dataclass
class _Released:
    """Storages whose memory was handed back, with what their return needs."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    # Level 1 on a GPU: the host copies that go back on wake-up.
    host_copies: list[torch.Tensor] | None = None
    # The tensors whose contents are gone (level 2): refilled from a fresh load, by name.
    reload: dict[str, torch.Tensor] | None = None


class WorkerSleepMode:
    """One worker's sleep state: which of SLEEP_TAGS are asleep, and their memory."""

    def __init__(
        self,
        kv_tensors: Callable[[], list[torch.Tensor]],
        weight_tensors: Callable[[], dict[str, torch.Tensor]],
        load_weights: Callable[[], dict[str, torch.Tensor]],
    ) -> None:
        self._kv_tensors = kv_tensors
        self._weight_tensors = weight_tensors
        self._load_weights = load_weights
        self._released: dict[str, _Released] = {}

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def sleep(self, level: int) -> int:
        """Hands back the KV cache's memory (and the weights', level 2); returns the bytes
        freed. Asleep already: only a deeper level frees more (the weights)."""
        check_sleep_level(level)
        freed = 0
        if KV_CACHE not in self._released:
            released = _release(_unique_storages(self._kv_tensors()))
            freed += sum(released.sizes)
            self._released[KV_CACHE] = released
        weights = self._released.get(WEIGHTS)
        if weights is None or (level == 2 and weights.reload is None):
            if weights is not None:
                self._wake_weights(weights)  # a level-1 sleep's copies, before dropping
            released = self._sleep_weights(level)
            freed += sum(released.sizes)
            self._released[WEIGHTS] = released
        _release_device_cache()
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in check_wake_tags(tags):
            released = self._released.pop(tag, None)
            if released is None:
                continue
            if tag == WEIGHTS:
                self._wake_weights(released)
            else:
                _restore(released, zero=True)

    def _sleep_weights(self, level: int) -> _Released:
        named = self._weight_tensors()
        # On the CPU only the huge-page regions the loader moved the weights to (all but
        # the tensors under 64 KiB): their memory is anonymous and the model's alone.
        regions = live_regions()
        on_device = {
            name: t
            for name, t in named.items()
            if t.device.type != "cpu" or t.untyped_storage().data_ptr() in regions
        }
        if level == 1 and all(t.device.type == "cpu" for t in on_device.values()):
            return _Released()  # already in host memory: kept as they are
        storages = _unique_storages(list(on_device.values()))
        host_copies = None
        if level == 1:
            host_copies = [_as_bytes(s).to("cpu") for s in storages]
        released = _release(storages)
        released.host_copies = host_copies
        if level == 2:
            released.reload = on_device
        return released

    def _wake_weights(self, released: _Released) -> None:
        _restore(released, zero=False)
        if released.host_copies is not None:
            for storage, copy in zip(released.storages, released.host_copies, strict=True):
                _as_bytes(storage).copy_(copy)
        if released.reload is not None:
            self._reload(released.reload)

    def _reload(self, targets: dict[str, torch.Tensor]) -> None:
        fresh = self._load_weights()
        missing = sorted(set(targets) - set(fresh))
        if missing:
            raise RuntimeError(f"the reloaded model lacks {len(missing)} tensors: {missing[:3]}")
        # Tensors made under inference mode may only be written under it.
        with torch.inference_mode():
            for name, tensor in targets.items():
                tensor.copy_(fresh[name])
        del fresh
        gc.collect()  # the fresh model's region is unmapped once nothing holds it
        HeapTrimmer().trim()  # and the loader's buffers go back to the OS


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _release(storages: list[torch.UntypedStorage]) -> _Released:
    released = _Released()
    for storage in storages:
        released.storages.append(storage)
        released.sizes.append(storage.nbytes())
        if storage.device.type == "cpu":
            _discard_pages(storage.data_ptr(), storage.nbytes())
        else:
            storage.resize_(0)
    return released


def _restore(released: _Released, zero: bool) -> None:
    """Gives device storages their memory back (zeroed: a KV cache's); CPU pages come
    back by themselves, as zero pages, when they are touched."""
    for storage, nbytes in zip(released.storages, released.sizes, strict=True):
        if storage.device.type != "cpu":
            storage.resize_(nbytes)
            if zero:
                _as_bytes(storage).zero_()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


_madvise: Callable[[int, int, int], int] | None = None


def _discard_pages(address: int, nbytes: int) -> None:
    """Hands the whole pages of [address, address + nbytes) back to the OS; they read as
    zero when touched again. The partial pages at either end may hold others' bytes."""
    global _madvise
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start:
        return
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    if _madvise(start, end - start, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


def _release_device_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

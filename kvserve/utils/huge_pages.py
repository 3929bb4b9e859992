"""Host memory on transparent huge pages for what every decode step streams from DRAM.

A decode step reads every weight once (SmolLM2-135M's Q4_1 blocks: 90 MB a token) and
each running request's KV cache; on 4 KiB pages that is a TLB miss and a page walk every
4 KiB. One thread streaming 63 MB of Q4_1 blocks through the GEMV, the two page sizes
alternating in one process (best of 20): 4.5-4.9 ms on 2 MiB pages against 5.0-5.3 ms on
4 KiB pages, means 6.1-7.8 against 7.5-8.9 ms (AMD EPYC Zen 5, 2 vCPU). End to end, the
default model's single stream (256 tokens offline, the builds alternating, 15 runs each):
149 -> 166 tok/s on average, 1.11x; 16-row decode steps gained ~3%.

The KV cache's memory is touched 2 MiB at a time rather than 4 KiB, so its resident size
runs ahead of the blocks in use (by ~110 MB for the default model's first requests).

Linux's default for anonymous memory is ``madvise`` (huge pages only where asked for), so
the memory is mapped here and asked for with ``MADV_HUGEPAGE`` before it is touched.
Where the kernel cannot give huge pages (THP ``never``, no ``madvise`` in Python's mmap,
other systems) the same code runs on ordinary pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
# Tensors below this (norm weights, biases) stay where they are: they are read from cache.
MIN_MOVE_BYTES = 64 << 10
_ALIGN = 64  # the kernels' vector loads, as torch's allocator aligns
_TRIM_BYTES = 256 << 20
# The regions move_to_huge_pages made that are still mapped, by start address: a tensor
# whose storage starts at one was moved already.
_live_regions: set[int] = set()


def huge_page_zeros(nbytes: int, *, track: bool = False) -> torch.Tensor:
    """``nbytes`` zero bytes (uint8) starting on a huge-page boundary, not yet touched:
    pages fresh from the OS are zero, so nothing is written until the memory is used.
    ``track``: counted in live_regions() until unmapped."""
    # Private: a shared anonymous mapping is shmem, whose huge pages are off by default.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = whole.data_ptr()
    if track:
        _live_regions.add(start)
        weakref.finalize(mapping, _live_regions.discard, start)
    offset = -start % HUGE_PAGE_BYTES
    return whole[offset : offset + nbytes]


def live_regions() -> frozenset[int]:
    """The start addresses of the regions move_to_huge_pages made that are still mapped
    (held by some tensor); a moved tensor's ``untyped_storage().data_ptr()`` is one."""
    return frozenset(_live_regions)


def thp_enabled() -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks for them."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def anon_huge_bytes(address: int) -> int:
    """Bytes on huge pages in this process's mapping that holds ``address`` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no mapping of this process holds {address:#x}")


def module_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a model's modules hold: parameters, buffers, tensor attributes and the
    tensor fields of dataclass attributes and of the dataclasses in their list fields (a
    linear layer's ``BlockWeight`` planes, a ``MixedBlockWeight``'s parts').
    Modules marked ``shared_across_models`` (one instance cached for every model, e.g.
    get_rope's) are left out: a tensor of theirs in a model's region would keep the whole
    region alive after the model is gone."""
    for module in model.modules():
        if getattr(module, "shared_across_models", False):
            continue
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value
            else:
                yield from _dataclass_tensors(value)


def _dataclass_tensors(value: object) -> Iterator[torch.Tensor]:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, list):
            for element in item:
                yield from _dataclass_tensors(element)


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copies the CPU storages of ``tensors`` (each 64 KiB or more) into one huge-page
    region and points every tensor at its copy in place (``set_``), so whoever holds the
    tensor sees the new memory; tensors that shared a storage still share one. Returns
    the bytes moved."""
    groups: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) in seen or tensor.device.type != "cpu" or tensor.is_sparse:
            continue
        seen.add(id(tensor))
        storage = tensor.untyped_storage()
        if storage.nbytes() < MIN_MOVE_BYTES or storage.data_ptr() in _live_regions:
            continue  # small, or moved already (its storage is a whole region)
        groups.setdefault(storage.data_ptr(), []).append(tensor)
        storages[storage.data_ptr()] = storage
    if not groups:
        return 0
    offsets: dict[int, int] = {}
    total = 0
    for key, storage in storages.items():
        offsets[key] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    region = huge_page_zeros(total, track=True)
    target = region.untyped_storage()
    base = region.data_ptr() - target.data_ptr()  # the region's offset in its mapping
    # The region's pages are taken as they are written, and each old storage is freed once
    # its tensors point at the copy (nothing else may hold it), so the move needs little
    # more memory than the model, not twice it: the heap's freed pages go back to the OS
    # every _TRIM_BYTES.
    unreleased = 0
    # Inference mode: tensors made under it may only be changed under it (and others may).
    with torch.inference_mode():
        for key, members in groups.items():
            storage, start = storages.pop(key), offsets[key]
            nbytes = storage.nbytes()
            # memmove, not torch's copy_: a copy this size is an OpenMP region, whose
            # threads spin at its barrier while other processes hold the cores (on a
            # loaded 2-core machine, 0.6-1.4 s of CPU for SmolLM2's 200 MB, against
            # 0.02-0.05 s for one thread's memcpy, which is no slower on a quiet one).
            ctypes.memmove(region.data_ptr() + start, storage.data_ptr(), nbytes)
            del storage
            for tensor in members:
                byte_offset = base + start + tensor.storage_offset() * tensor.element_size()
                tensor.set_(
                    target, byte_offset // tensor.element_size(), tensor.size(), tensor.stride()
                )
            unreleased += nbytes
            if unreleased >= _TRIM_BYTES:
                _release_freed_heap()
                unreleased = 0
    _release_freed_heap()
    return total


def _release_freed_heap() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim): the old copies
    of layer-sized tensors were malloc'ed from the heap, and freed they would stay resident
    (~60 MB of SmolLM2's 200)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc's among them
    except (OSError, AttributeError):  # not glibc
        pass

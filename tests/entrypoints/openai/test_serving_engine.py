"""merge_async_iterators: interleaves sources, and closing it cancels every source."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvserve.entrypoints.openai.serving_engine import merge_async_iterators


def test_merge_interleaves_and_tags_each_item() -> None:
    async def source(name: str, delay: float) -> AsyncIterator[str]:
        for i in range(3):
            await asyncio.sleep(delay)
            yield f"{name}{i}"

    async def main() -> list[tuple[int, str]]:
        return [item async for item in merge_async_iterators(source("a", 0.01), source("b", 0.015))]

    items = asyncio.run(main())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (1, "b2")]
    assert [s for i, s in items if i == 0] == ["a0", "a1", "a2"]  # order kept per source


@pytest.mark.parametrize("num_sources", [1, 3])
def test_closing_the_merge_cancels_every_source(num_sources: int) -> None:
    cancelled: list[int] = []

    async def endless(index: int) -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield index
        except (asyncio.CancelledError, GeneratorExit):
            cancelled.append(index)  # where AsyncLLM.generate aborts its request
            raise

    async def main() -> None:
        merged = merge_async_iterators(*(endless(i) for i in range(num_sources)))
        await anext(merged)
        await merged.aclose()

    asyncio.run(main())
    assert sorted(cancelled) == list(range(num_sources))


def test_an_error_in_one_source_reaches_the_consumer() -> None:
    async def bad() -> AsyncIterator[int]:
        raise ValueError("bad input")
        yield 0  # pragma: no cover

    async def good() -> AsyncIterator[int]:
        await asyncio.sleep(10)
        yield 1

    async def main() -> None:
        async for _ in merge_async_iterators(good(), bad()):
            pass

    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(asyncio.wait_for(main(), timeout=5))

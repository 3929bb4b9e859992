"""The proxy's instance specs and its pick: fewest in flight, then fewest served; and the
prefill copy of a request."""

from __future__ import annotations

import time

import pytest

from kvserve.entrypoints.disagg.pool import Instance, Pool
from kvserve.entrypoints.disagg.proxy import DisaggProxy, disaggregates


def test_instance_specs() -> None:
    plain = Instance.parse("http://h:8001/", "--decode")
    assert (plain.url, plain.kv_host, plain.kv_port) == ("http://h:8001", None, None)
    p2p = Instance.parse("http://h:8001=10.0.0.2:14579", "--decode")
    assert (p2p.kv_host, p2p.kv_port) == ("10.0.0.2", 14579)
    for bad in ("h:8001", "http://h:8001=10.0.0.2", "http://h:8001=h:99999"):
        with pytest.raises(ValueError, match="--decode"):
            Instance.parse(bad, "--decode")


def test_pick_spreads_by_load_then_use() -> None:
    a, b = Instance("http://a"), Instance("http://b")
    pool = Pool([a, b], "--prefill")
    picked = []
    for _ in range(4):
        instance = pool.pick()
        instance.served += 1
        picked.append(instance.url)
    assert picked == ["http://a", "http://b", "http://a", "http://b"]
    a.in_flight = 2
    assert pool.pick() is b
    b.failed_at = time.monotonic()  # refused a connection just now: tried last
    assert pool.by_preference() == [a, b]
    with pytest.raises(ValueError, match="at least one --decode"):
        Pool([], "--decode")
    with pytest.raises(ValueError, match="named twice"):
        Pool([Instance("http://a"), Instance("http://a")], "--decode")


def test_prefill_copy() -> None:
    decoder = Instance("http://d", "127.0.0.1", 14579)
    proxy = DisaggProxy([Instance("http://p")], [decoder])
    body = {
        "prompt": "hi", "max_tokens": 50, "stream": True, "min_tokens": 5,
        "stream_options": {"include_usage": True}, "temperature": 0.0,
    }  # fmt: skip
    prefill = proxy.prefill_body(body, decoder)
    params = prefill.pop("kv_transfer_params")
    assert prefill == {"prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.0}
    assert params["do_remote_decode"] and params["remote_port"] == 14579
    assert len(params["transfer_id"]) == 32
    # A decoder without a KV address (a shared tier): no params at all.
    assert "kv_transfer_params" not in proxy.prefill_body(body, Instance("http://d2"))
    assert body["max_tokens"] == 50  # the client's request is left as it was


def test_which_requests_are_disaggregated() -> None:
    assert disaggregates({"prompt": "hi"}) and disaggregates({"prompt": [1, 2, 3]})
    assert disaggregates({"messages": [{"role": "user", "content": "hi"}], "n": 3})
    assert not disaggregates({"prompt": ["a", "b"]})  # a batch: one transfer per prompt
    assert not disaggregates({"prompt": [[1, 2], [3]]})
    assert not disaggregates({"prompt": "hi", "use_beam_search": True})

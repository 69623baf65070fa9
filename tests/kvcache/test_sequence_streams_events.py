"""The pure parts of the event plane: sequence numbers, where instances publish, the messages."""

from __future__ import annotations

import msgspec
import pytest

from epd_proxy.config import InstanceSpec, parse_instance
from epd_proxy.instances.roster import RegistrationError, parse_registration
from epd_proxy.kvcache import events
from epd_proxy.kvcache.index import BlockIndex
from epd_proxy.kvcache.sequence import APPLY, DUPLICATE, GAP, RESTART, SequenceTracker
from epd_proxy.kvcache.streams import instance_of, offset, streams_of


def test_sequence_classification():
    t = SequenceTracker()
    assert t.classify(5, 0.0) == APPLY  # nothing seen: whatever comes first
    t.applied(5)
    assert t.classify(6, 0.0) == APPLY
    assert t.classify(9, 0.0) == GAP
    assert t.classify(3, 0.0) == RESTART
    t.replayed(3, 5, now=10.0)
    assert t.classify(4, 11.0) == DUPLICATE
    assert t.classify(4, 20.0) == RESTART  # long after the replay: a restart
    t.reset()
    assert t.expected == 0 and t.classify(0, 0.0) == APPLY


def test_streams_from_attributes_and_default_port():
    spec = parse_instance("http://p1:8000;kv_events=tcp://p1:5557", "prefill")
    (s,) = streams_of(spec, None)
    assert (s.name, s.endpoint, s.replay) == ("http://p1:8000", "tcp://p1:5557", "tcp://p1:5558")
    spec = parse_instance("http://p1:8000;kv_events=tcp://p1:5557;kv_events_replay=none", "prefill")
    assert streams_of(spec, None)[0].replay is None
    plain = InstanceSpec("http://10.0.0.5:8000", "decode", dp_size=2)
    a, b = streams_of(plain, 6000)
    assert (a.endpoint, a.replay, b.endpoint, b.replay) == (
        "tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001", "tcp://10.0.0.5:6001", "tcp://10.0.0.5:6002")
    assert b.name == "http://10.0.0.5:8000#dp1" and instance_of(b.name) == plain.url
    assert streams_of(plain, None) == []
    assert streams_of(InstanceSpec("http://e:1", "encode"), 6000) == []
    off = parse_instance("http://p1:8000;kv_events=none", "prefill")
    assert streams_of(off, 6000) == []
    assert offset("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_bad_endpoints_are_refused():
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_instance("http://p1:8000;kv_events=tcp://*:5557", "prefill")
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_instance("http://p1:8000;kv_events=p1:5557", "prefill")
    spec = parse_registration(b'{"role": "prefill", "url": "http://p1:8000", "kv_events": "tcp://p1:5557"}')
    assert spec.kv_events == "tcp://p1:5557"
    with pytest.raises(RegistrationError):
        parse_registration(b'{"role": "prefill", "url": "http://p1:8000", "kv_events": "5557"}')


def test_event_batch_applied():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": [99], "parent_block_hash": None, "token_ids": list(range(4)),
         "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None},  # another tier: left out
        {"type": "SomethingNew"},
    ], 0])
    index = BlockIndex()
    assert events.apply(index, "a", events.decode_batch(payload)) == 2
    assert index.longest_prefix(list(range(8))) == {"a": 8}
    removed = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}], 0])
    events.apply(index, "a", events.decode_batch(removed))
    assert index.longest_prefix(list(range(8))) == {"a": 4}
    events.apply(index, "a", events.decode_batch(msgspec.msgpack.encode([3.0, [{"type": "AllBlocksCleared"}], 0])))
    assert len(index) == 0
    assert events.sequence((-1).to_bytes(8, "big", signed=True)) == events.END_SEQ
    assert events.replay_request(7) == [b"", (7).to_bytes(8, "big")]
    with pytest.raises(events.WireError):
        events.decode_batch(b"\xc1")

"""Pure pieces of the KV side channel (the hand-off itself is tested over sockets in
test_kv.py and test_push.py)."""

from epd_proxy.sim.kv_channel import flat_ints


def test_block_ids_compare_flat():
    assert flat_ints([[1, 2], [3]]) == flat_ints([1, 2, 3]) == [1, 2, 3]
    assert flat_ints(7) == [7]

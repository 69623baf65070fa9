"""Hot-path ids: the right shape, unique, and fresh in a forked worker."""

import os
import re
import uuid

from epd_proxy.wire.ids import hex_id, uuid4_str


def test_hex_ids_have_a_digit_per_four_bits():
    assert re.fullmatch(r"[0-9a-f]{32}", hex_id())
    assert re.fullmatch(r"[0-9a-f]{12}", hex_id(48))
    assert len({hex_id(48) for _ in range(1000)}) == 1000


def test_uuids_are_version_4_in_the_usual_form():
    text = uuid4_str()
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", text)
    assert uuid.UUID(text).version == 4
    assert len({uuid4_str() for _ in range(1000)}) == 1000


def test_a_forked_child_does_not_repeat_the_parents_ids():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the next id, to the parent
        try:
            os.write(write, hex_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child != hex_id() and re.fullmatch(r"[0-9a-f]{32}", child)

"""The round-robin policy's rotation: the reference proxy's encoder spread (#52484), one cursor
shared by every request, on indices."""

import pytest

from epd_proxy.routing.policies import RoundRobin, assign_round_robin


class RoundRobinCursor:
    """The round-robin policy over encoder indices ``0..n-1``."""

    def __init__(self) -> None:
        self.policy = RoundRobin()

    def take(self, count: int, n: int) -> list[int]:
        return self.policy.assign(list(range(n)), [None] * count)

    @property
    def position(self) -> int:
        return self.policy._cursor


# ---------------------------------------------------------------- round robin


def test_assign_round_robin_basic():
    assert assign_round_robin(0, 3, 4) == ([0, 1, 2, 0], 1)
    assert assign_round_robin(2, 3, 2) == ([2, 0], 1)
    assert assign_round_robin(7, 3, 1) == ([1], 2)
    assert assign_round_robin(1, 3, 0) == ([], 1)


def test_assign_round_robin_rejects_no_encoders():
    with pytest.raises(ValueError):
        assign_round_robin(0, 0, 1)
    with pytest.raises(ValueError):
        assign_round_robin(0, 2, -1)


def test_single_item_requests_rotate_through_all_encoders():
    cursor = RoundRobinCursor()
    assert [cursor.take(1, 3)[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_cursor_stays_contiguous_across_varying_item_counts():
    cursor = RoundRobinCursor()
    assert [cursor.take(c, 3) for c in [2, 1, 3, 1]] == [[0, 1], [2], [0, 1, 2], [0]]
    assert cursor.position == 1


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_full_url_space_is_covered_uniformly(n):
    cursor = RoundRobinCursor()
    hits = [0] * n
    for _ in range(3 * n):
        (e,) = cursor.take(1, n)
        hits[e] += 1
    assert hits == [3] * n


def test_single_encoder_always_resolves_to_it():
    cursor = RoundRobinCursor()
    for count in [1, 3, 2, 5]:
        assert cursor.take(count, 1) == [0] * count
        assert cursor.position == 0


def test_cursor_survives_roster_change():
    cursor = RoundRobinCursor()
    assert cursor.take(3, 4) == [0, 1, 2]
    # Shrinks to 2 encoders: the cursor (3) is taken mod 2 and keeps moving.
    assert cursor.take(2, 2) == [1, 0]
    assert cursor.take(1, 2) == [1]

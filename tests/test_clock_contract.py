"""One behavioural contract for the clock role, run against the real Clock and the fake of
tests/fakes.py: what the operations rely on when they time phases (``monotonic`` differences,
never negative), wait for a deadline (a poll's ``sleep`` moves ``monotonic`` on by at least what
it asked, so every deadline loop ends) and stamp records (``now`` is Unix seconds). A fake whose
``sleep`` did not move its time made a deadline loop spin without end, and one that accepted a
negative sleep hid an argument the real clock refuses."""

from __future__ import annotations

import pytest

from fakes import FakeWorld
from vllm_snapshot.effects.runtime import LocalClock

#: a poll's sleep in these tests, seconds: short, so the real clock's cases take milliseconds
POLL_S = 0.01


@pytest.fixture(params=["local", "fake"])
def clock(request):
    return LocalClock() if request.param == "local" else FakeWorld().tools.clock


def test_monotonic_never_goes_back(clock):
    readings = []
    for i in range(20):
        readings.append(clock.monotonic())
        if i % 5 == 4:
            clock.sleep(0)
    assert readings == sorted(readings), readings


# 1.5 s: more than the second the fake adds per reading, so only the sleep itself can cover it
@pytest.mark.parametrize("seconds", [0.0, POLL_S, 1.5])
def test_sleep_moves_monotonic_on_by_at_least_what_it_asked(clock, seconds):
    t0 = clock.monotonic()
    clock.sleep(seconds)
    assert clock.monotonic() - t0 >= seconds


def test_a_negative_sleep_is_refused(clock):
    t0 = clock.monotonic()
    with pytest.raises(ValueError):
        clock.sleep(-POLL_S)
    assert clock.monotonic() >= t0


def test_a_deadline_loop_ends_no_sooner_than_its_deadline_and_after_a_bounded_number_of_polls(clock):
    # the operations' pattern (ops/restore.py's bind wait, ops/switch.py's hand-over wait)
    wait_s = 5 * POLL_S
    start = clock.monotonic()
    deadline = start + wait_s
    polls = 0
    while True:
        now = clock.monotonic()
        if now > deadline:
            break
        clock.sleep(POLL_S)
        polls += 1
        assert polls <= wait_s / POLL_S + 1, "sleep does not move the clock on: the loop would never end"
    assert now - start > wait_s


def test_now_is_unix_seconds_and_a_sleep_does_not_send_it_back(clock):
    t = clock.now()
    assert isinstance(t, float)
    assert 1_500_000_000 < t < 4_102_444_800  # between 2017 and 2100: seconds, not ms or ns
    clock.sleep(POLL_S)
    assert clock.now() >= t

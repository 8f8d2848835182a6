"""The ranks' agreement on whether to exchange: every rank gets the same answer, whatever the timing.

Ranks are simulated with threads over one in-memory store (``torch.distributed.HashStore``, the
store interface torchrun's TCPStore implements). A rank that arrives as another times out is the
case that matters: two different answers would leave one rank in an all-reduce the other never
joins, or matched against the user's own collective."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.parallel import exchange as ranks


def _run(delays: list[float], timeout: float, build: list[bool] | None = None) -> list[bool | None]:
    store = dist.HashStore()
    answers: list[bool | None] = [None] * len(delays)

    def rank(r: int) -> None:
        time.sleep(delays[r])
        if build is None or build[r]:
            answers[r] = ranks.agree(store, "ampdoctor/monitor0", r, len(delays), timeout)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(len(delays))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return answers


def test_every_rank_on_time_exchanges() -> None:
    assert _run([0.0, 0.01], timeout=2.0) == [True, True]


def test_a_rank_without_a_monitor_turns_every_other_rank_off() -> None:
    assert _run([0.0, 0.0, 0.0], timeout=0.1, build=[True, True, False]) == [False, False, None]


def test_a_late_rank_follows_the_decision_the_first_rank_made() -> None:
    assert _run([0.0, 0.3], timeout=0.05) == [False, False]  # rank 0 timed out first: both go without


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=0.0, max_value=0.06), st.floats(min_value=0.0, max_value=0.06))
def test_the_ranks_always_agree_at_the_timeout_edge(d0: float, d1: float) -> None:
    a = _run([d0, d1], timeout=0.03)  # arrivals straddle the timeout
    assert a[0] == a[1], a


def test_a_later_monitor_uses_keys_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(ranks, "_made", [0])
    with pytest.warns(RuntimeWarning, match="not every rank built a Monitor within 0.01 s"):
        assert ranks.handshake(0, 2, 0.01) is False  # rank 1 never came: this monitor goes without
    store.set("ampdoctor/monitor1/rank1", "1")  # rank 1's second monitor is on time for the second round
    assert ranks.handshake(0, 2, 1.0) is True


class _SlowAfterTimeout:
    """A store through which one rank writes slowly once its wait has timed out (a loaded machine)."""

    def __init__(self, store: dist.Store, delay: float) -> None:
        self.store, self.delay, self.timed_out = store, delay, False

    def set(self, key: str, value: str) -> None:
        if self.timed_out:
            time.sleep(self.delay)
        self.store.set(key, value)

    def wait(self, keys: list[str], timeout: object) -> None:
        try:
            self.store.wait(keys, timeout)
        except Exception:
            self.timed_out = True
            raise

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.timed_out:
            time.sleep(self.delay)
        return self.store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)


def test_a_rank_arriving_while_the_other_is_still_turning_off_gets_the_same_answer() -> None:
    store = dist.HashStore()
    answers: dict[int, bool] = {}
    slow = _SlowAfterTimeout(store, delay=0.3)  # rank 0 times out at 0.05 s, then takes 0.3 s to say so

    def rank0() -> None:
        answers[0] = ranks.agree(slow, "m", 0, 2, 0.05)

    def rank1() -> None:
        time.sleep(0.15)  # after rank 0's timeout, before rank 0 has written anything
        answers[1] = ranks.agree(store, "m", 1, 2, 5.0)

    ts = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert answers[0] == answers[1] is True  # both built a monitor; the first decision stored was rank 1's "on"

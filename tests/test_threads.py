"""The thread-count decision (`minfer.engine.threads`): measured step times pick the count,
and a change of load is followed; without hardware, on made-up step times."""

from __future__ import annotations

from minfer.engine.threads import ThreadTuner


def _drive(tuner: ThreadTuner, step_time: dict[int, float], steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        n = tuner.choose("decode")
        tuner.record("decode", n, step_time[n])
        chosen.append(n)
    return chosen


def test_measures_each_count_then_keeps_the_fastest() -> None:
    tuner = ThreadTuner(4, samples=3, every=50)
    assert tuner.candidates == [4, 3, 1]
    chosen = _drive(tuner, {4: 0.010, 3: 0.012, 1: 0.030}, 40)
    assert chosen[:9] == [4, 4, 4, 3, 3, 3, 1, 1, 1]
    assert set(chosen[9:]) == {4}


def test_a_busy_core_moves_it_to_fewer_threads_and_back() -> None:
    tuner = ThreadTuner(2, samples=3, every=20)
    idle = {2: 0.018, 1: 0.036}
    busy = {2: 0.200, 1: 0.036}  # a spinning barrier next to another process
    # the other count is re-measured (3 steps) every 20 steps: the rest go to the fastest
    assert _drive(tuner, idle, 30)[-20:].count(2) >= 17
    assert _drive(tuner, busy, 60)[-20:].count(1) >= 17
    assert _drive(tuner, idle, 60)[-20:].count(2) >= 17


def test_one_core_has_nothing_to_choose() -> None:
    tuner = ThreadTuner(1)
    assert _drive(tuner, {1: 0.03}, 5) == [1] * 5

"""posteriorzoo._pipeline: read-ahead and write-behind keep order, bound what waits, and
raise a worker's error in the caller."""

from __future__ import annotations

import threading
import time

import pytest

from posteriorzoo._pipeline import WriteBehind, read_ahead


def test_read_ahead_yields_every_item_in_order_and_runs_at_most_depth_ahead():
    produced = []

    def items():
        for i in range(20):
            produced.append(i)
            yield i

    seen = []
    for item in read_ahead(items(), depth=2):
        time.sleep(0.002)
        # the item being used, the `depth` waiting in the queue, and the one the producer
        # holds while it waits for room
        assert len(produced) <= item + 1 + 2 + 1
        seen.append(item)
    assert seen == list(range(20))


def test_read_ahead_raises_the_producers_error_where_its_item_would_be():
    def items():
        yield 1
        yield 2
        raise ValueError("broken block")

    seen = []
    with pytest.raises(ValueError, match="broken block"):
        for item in read_ahead(items()):
            seen.append(item)
    assert seen == [1, 2]


def test_closing_read_ahead_early_stops_its_producer():
    produced = []

    def items():
        for i in range(10_000):
            produced.append(i)
            yield i

    reader = read_ahead(items(), depth=1)
    assert next(reader) == 0
    reader.close()
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count <= 3
    assert not any(t.name == "posteriorzoo-read-ahead" for t in threading.enumerate())


def test_write_behind_runs_writes_in_order_one_thread_and_waits_at_exit():
    done, threads = [], set()

    def write(i):
        time.sleep(0.005)
        threads.add(threading.get_ident())
        done.append(i)

    with WriteBehind() as writer:
        for i in range(10):
            writer.submit(write, i)
            assert len(done) >= i - 1      # at most one write waits behind the caller
    assert done == list(range(10))
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_failed_write_is_raised_and_stops_the_later_ones():
    done = []

    def write(i):
        if i == 3:
            raise OSError("disk full")
        done.append(i)

    with pytest.raises(OSError, match="disk full"), WriteBehind() as writer:
        for i in range(10):
            writer.submit(write, i)
    assert done == [0, 1, 2]

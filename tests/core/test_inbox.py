"""The core takes the replica's fire-and-forget messages in the order sent, whatever order Ray runs
the calls in."""

import threading

import pytest

from warpspec.core.inbox import CoreInbox
from warpspec.core.messages import CoreInput


def test_messages_are_taken_in_number_order_and_a_gap_holds_back_the_rest():
    inbox = CoreInbox()
    inbox.put(CoreInput(0, aborts=["a"]))
    inbox.put(CoreInput(2, aborts=["c"]))
    # 1 has not arrived: 2 must wait, or an abort could overtake the add it refers to.
    assert [m.number for m in inbox.take(wait=False)] == [0]
    assert inbox.take(wait=False) == []
    inbox.put(CoreInput(1, aborts=["b"]))
    assert [m.aborts for m in inbox.take(wait=False)] == [["b"], ["c"]]


def test_a_number_received_twice_is_refused():
    inbox = CoreInbox()
    inbox.put(CoreInput(0))
    inbox.put(CoreInput(1))
    inbox.take(wait=False)
    with pytest.raises(ValueError, match="core message 0 was already received"):
        inbox.put(CoreInput(0))
    inbox.put(CoreInput(3))
    with pytest.raises(ValueError, match="core message 3 was already received"):
        inbox.put(CoreInput(3))


def test_take_waits_for_the_next_message_and_close_ends_the_wait():
    inbox = CoreInbox()
    taken = []
    reader = threading.Thread(target=lambda: taken.append(inbox.take(wait=True)))
    reader.start()
    inbox.put(CoreInput(0, aborts=["x"]))
    reader.join(timeout=5)
    assert not reader.is_alive() and taken[0][0].aborts == ["x"]

    reader = threading.Thread(target=lambda: taken.append(inbox.take(wait=True)))
    reader.start()
    inbox.close()
    reader.join(timeout=5)
    assert not reader.is_alive() and taken[1] is None

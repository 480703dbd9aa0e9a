"""Where the replica's messages wait for the engine core's loop, taken strictly in the order sent.

The replica sends each CoreInput fire-and-forget while the core steps in another thread of the
coordinator actor. Ray does not promise that calls to a threaded actor run in the order they were
made, so every message carries its number and the core takes only the unbroken run from the next
number it expects:

    arrived 0, 2, 1  ->  take() gives [0, 1, 2]
    arrived 0, 2     ->  take() gives [0]; 2 waits for 1
"""

from __future__ import annotations

import threading

from warpspec.core.messages import CoreInput


class CoreInbox:
    def __init__(self):
        self.ready = threading.Condition()
        self.arrived: dict[int, CoreInput] = {}
        self.next_number = 0
        self.is_closed = False

    def put(self, message: CoreInput) -> None:
        with self.ready:
            if message.number < self.next_number or message.number in self.arrived:
                raise ValueError(f"core message {message.number} was already received")
            self.arrived[message.number] = message
            self.ready.notify()

    def take(self, wait: bool) -> list[CoreInput] | None:
        """The messages ready in order (maybe none); with wait, blocks until there is one. None once
        closed: the core's loop ends."""
        with self.ready:
            while wait and self.next_number not in self.arrived and not self.is_closed:
                self.ready.wait()
            if self.is_closed:
                return None
            taken = []
            while self.next_number in self.arrived:
                taken.append(self.arrived.pop(self.next_number))
                self.next_number += 1
            return taken

    def close(self) -> None:
        with self.ready:
            self.is_closed = True
            self.ready.notify_all()

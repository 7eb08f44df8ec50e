"""The events pipe's framing: each message one pickle, after its length.

The engine process writes whole frames to a blocking pipe (if the HTTP process falls behind,
the pipe fills and the engine's loop waits: back-pressure). The HTTP process reads the pipe on
its event loop, without a thread: a reader thread had to win the GIL back from the busy event
loop for every message (up to the 5 ms switch interval each time, and once per replica), then
wake the loop again with call_soon_threadsafe.
"""
from __future__ import annotations

import os
import pickle
import struct

_LENGTH = struct.Struct("<Q")


def write_frame(fd: int, message: object) -> None:
    """Blocking: returns once the whole frame is in the pipe."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Bytes as they come off the pipe -> the whole messages among them."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        buf = self._buf
        buf += data
        messages, pos = [], 0
        with memoryview(buf) as view:
            while len(buf) - pos >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(buf, pos)
                start = pos + _LENGTH.size
                if len(buf) - start < size:
                    break  # the rest of this message is still on its way
                messages.append(pickle.loads(view[start:start + size]))
                pos = start + size
        del buf[:pos]
        return messages

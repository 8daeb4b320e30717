"""First come, first served waiting for the one-shot HTTP requests (an upload, a completion, a chat) that find the
server full, as vLLM queues the requests beyond its max_num_seqs: a client sending a batch at once is slowed down,
not refused. A realtime stream or a streaming-input request is refused at once instead: it cannot wait without
losing the input it is being sent.

Only the request at the head of a queue looks for room, every POLL_S; the ones behind it wait for their turn (and
look at their client and their deadline every CHECK_S), so a thousand waiting requests cost the event loop what one
does, and a request is served before any that came after it.
"""
import asyncio
import collections
import time
import typing

POLL_S = 0.05  # how often the request at the head looks for room
CHECK_S = 1.0  # how often a request behind it checks whether its client went away or its time is up

T = typing.TypeVar("T")


class RequestQueue:
    def __init__(self):
        self._waiting: collections.deque[asyncio.Future] = collections.deque()  # turns, in arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    async def take(self, attempt: typing.Callable[[], typing.Awaitable[T | None]], wait_s: float,
                   gone: typing.Callable[[], bool] = lambda: False, max_waiting: int | None = None) -> T | None:
        """The first result of `attempt()` that is not None (None: no room now; it may raise to end the wait, e.g.
        for a draining server): at once when no request waits and there is room, else once every request that came
        before is served. None when `wait_s` passes first (0: no wait), `gone()` says the client left, or
        `max_waiting` requests wait already (each holds the body it sent)."""
        if not self._waiting and (result := await attempt()) is not None:
            return result
        if max_waiting is not None and len(self._waiting) >= max_waiting:
            return None
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        if self._waiting[0] is turn:
            turn.set_result(None)
        deadline = time.monotonic() + wait_s
        try:
            while (remaining := deadline - time.monotonic()) > 0 and not gone():
                if not turn.done():
                    await asyncio.wait([turn], timeout=min(CHECK_S, remaining))
                elif (result := await attempt()) is not None:
                    return result
                else:
                    await asyncio.sleep(min(POLL_S, remaining))
            return None
        finally:
            head = self._waiting[0] is turn
            self._waiting.remove(turn)
            if head and self._waiting:
                self._waiting[0].set_result(None)  # the next request's turn

"""Waiting for the one-shot HTTP requests (an upload, a completion, a chat) that find the server full, as vLLM queues
the requests beyond its max_num_seqs: a client sending a batch at once is slowed down, not refused. A realtime stream
or a streaming-input request is refused at once instead: it cannot wait without losing the input it is being sent.

Turns go round the client keys (limits.KeyLimits: the API key, or the client's address), first come first served
within a key, as a gateway's flow control cycles through its tenants (llm-d's): the request of a key with none
waiting goes behind at most one request of each other key, so one client's batch of a hundred does not hold back
another client's one request. While a single key waits (one client, or every client behind one proxy address) that is
plain first come first served.

A waiting room full (`max_waiting`: each waiting request holds the body it sent) takes a newcomer only from a key that
holds fewer places than another: the key holding the most gives up its newest place (that request is answered as
over its key's share), as a fair queue drops from its fattest flow. No place is held back while no one else needs it:
a lone client may fill the room, and a newcomer finds it full only when every waiting key holds about as many
places as its own.

Only the request at the head of the queue looks for room, every POLL_S; the ones behind it wait for their turn (and
look at their client and their deadline every CHECK_S), so a thousand waiting requests cost the event loop what one
does.
"""
import asyncio
import bisect
import time
import typing

POLL_S = 0.05  # how often the request at the head looks for room
CHECK_S = 1.0  # how often a request behind it checks whether its client went away or its time is up

T = typing.TypeVar("T")


class OverShare(Exception):
    """A request refused at a full waiting room, or sent out of it for another key's newcomer, because its key
    held `held` of the `places` while other keys waited (a 429 rate_limit_exceeded, as the other per-key limits)."""

    def __init__(self, held: int, places: int, displaced: bool):
        if displaced:
            message = (f"This request gave its place in the server's queue up to another client's: this key held "
                       f"{held} of its {places} places; retry later")
        else:
            message = (f"This key holds {held} of the {places} places of the server's queue while other clients "
                       "wait; retry later")
        super().__init__(message)
        self.held, self.places, self.displaced = held, places, displaced


class _Waiter:
    __slots__ = ("key", "order", "turn", "sent_away")

    def __init__(self, key, order: tuple[int, int], turn: asyncio.Future):
        self.key, self.order, self.turn = key, order, turn
        self.sent_away: OverShare | None = None


class RequestQueue:
    def __init__(self):
        # By (round, arrival): a key's n-th waiting request plays in round n counted from the head's round, so the
        # head is the one whose turn it is and a newcomer never goes before it.
        self._waiting: list[_Waiter] = []
        self._by_key: dict[typing.Hashable, list[_Waiter]] = {}  # each key's waiting requests, oldest first
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._waiting)

    async def take(self, attempt: typing.Callable[[], typing.Awaitable[T | None]], wait_s: float,
                   gone: typing.Callable[[], bool] = lambda: False, max_waiting: int | None = None,
                   key: typing.Hashable = None) -> T | None:
        """The first result of `attempt()` that is not None (None: no room now; it may raise to end the wait, e.g.
        for a draining server): at once when no request waits and there is room, else once the requests before it
        in the turns of the keys (`key`: the client's) are served. None when `wait_s` passes first (0: no wait),
        `gone()` says the client left, or `max_waiting` requests wait already and no key holds more places than
        this one's; OverShare when `key` holds its share of a full room, or gave its place up to another key."""
        if not self._waiting and (result := await attempt()) is not None:
            return result
        if max_waiting is not None and len(self._waiting) >= max_waiting and not self._make_room(key, max_waiting):
            return None
        waiter = self._enqueue(key)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                if waiter.sent_away is not None:
                    raise waiter.sent_away
                remaining = deadline - time.monotonic()
                if remaining <= 0 or gone():
                    return None
                if not waiter.turn.done():
                    await asyncio.wait([waiter.turn], timeout=min(CHECK_S, remaining))
                elif (result := await attempt()) is not None:
                    return result
                else:
                    await asyncio.sleep(min(POLL_S, remaining))
        finally:
            if waiter.sent_away is None:
                self._remove(waiter)

    def _enqueue(self, key) -> _Waiter:
        mine = self._by_key.setdefault(key, [])
        head_round = self._waiting[0].order[0] if self._waiting else 0
        self._arrivals += 1
        order = (max(head_round, mine[-1].order[0] + 1) if mine else head_round, self._arrivals)
        waiter = _Waiter(key, order, asyncio.get_running_loop().create_future())
        mine.append(waiter)
        bisect.insort(self._waiting, waiter, key=lambda w: w.order)
        if self._waiting[0] is waiter:
            waiter.turn.set_result(None)
        return waiter

    def _remove(self, waiter: _Waiter) -> None:
        head = self._waiting[0] is waiter
        self._waiting.remove(waiter)
        mine = self._by_key[waiter.key]
        mine.remove(waiter)
        if not mine:
            del self._by_key[waiter.key]
        if head and self._waiting:
            self._waiting[0].turn.set_result(None)  # the next request's turn

    def _make_room(self, key, max_waiting: int) -> bool:
        """At a full waiting room: True when a place was freed for `key`'s newcomer (the newest request of the key
        holding at least two places more is sent away), False when the room is full for it too (no key holds much
        more than its own). OverShare when `key` already holds its share (the room over the waiting keys)."""
        if not self._by_key:
            return False  # a room of no places
        held = len(self._by_key.get(key, ()))
        fattest = max(self._by_key, key=lambda k: len(self._by_key[k]))
        most = len(self._by_key[fattest])
        # Two more, not one: taking one place of a key holding one more than `key` would only swap their counts.
        if most >= held + 2:
            victim = self._by_key[fattest][-1]  # never the head: its key holds two places at least
            self._remove(victim)
            victim.sent_away = OverShare(most, max_waiting, displaced=True)
            victim.turn.set_result(None)  # wakes it to answer
            return True
        if held and len(self._by_key) > 1 and held * len(self._by_key) >= max_waiting:
            raise OverShare(held, max_waiting, displaced=False)
        return False

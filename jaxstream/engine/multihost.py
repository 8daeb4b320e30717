"""One engine over a multi-host mesh: process 0 leads, every other process follows.

Under `jax.distributed` (jaxstream/distributed.py) every process builds the same engine core over the global
mesh: the same model, the same `EngineConfig`, the programs compiled in the same order. Process 0 runs the
scheduler (and the server); every dispatch of a compiled program is published to the followers, which run
the identical program on the identical batch, so the collectives inside a step (tensor parallelism across
the process boundary) meet. Outputs are replicated (`Placement.program_shardings`), so the leader reads
them from its own devices.

A dispatch crosses in two messages:
  1. its header, through the coordinator's key-value store: the program's index in compile order, or "stop".
     Followers wait on the store rather than in a collective because an idle leader may publish nothing for
     hours, far longer than a collective waits for its peers (gloo gives up after about 30 s).
  2. its batch, by `multihost_utils.broadcast_one_to_all`. That collective returns on the leader only once
     every follower has joined it, so every follower has read the header by then, and the leader deletes
     it: the store holds at most one header per engine.
Before the first dispatch, every process checks in at a barrier with the list of programs it compiled; the
leader refuses to start if a follower built something else.

A lost follower (jax 0.10.2, CPU and gloo, measured). With two devices per process a collective whose peer
died may raise ("connection reset") or may wait forever: a local device that already gave up leaves its
partner waiting on a healthy socket. So the leader does not rely on collectives failing: every follower
bumps a heartbeat counter in the store each second, and the leader's watchdog declares a follower lost
when its counter stops for `LOST_AFTER_S` (10 s; $JAXSTREAM_FOLLOWER_TIMEOUT_S sets another, for hosts whose
store round trips are slower, or a test that stops a follower on purpose). Either way the leader's `on_lost` ends
every session with `ProcessGroupError` and the engine stops (`healthy` is False, so `/health` answers 503); the
leader process survives because `distributed.initialize(..., recoverable=True)` turns off JAX's abort-on-peer-loss. A
follower whose leader dies is terminated by JAX's coordination service at once (the coordinator lived in
the leader), with JAX's "another task died" message. Neither side hangs; a LeaderWorkerSet then recreates
the group.
"""
import itertools
import logging
import os
import threading
import time

import jax
from jax.experimental import multihost_utils

from jaxstream import distributed
from jaxstream.errors import ProcessGroupError

logger = logging.getLogger(__name__)

_STOP = "stop"
_POLL_MS = 10_000  # how long one wait on the store lasts before the follower waits again
_HEARTBEAT_S = 1.0
# A follower whose heartbeat stops this long is lost.
LOST_AFTER_S = float(os.environ.get("JAXSTREAM_FOLLOWER_TIMEOUT_S", "10"))
_READY_TIMEOUT_MS = 15 * 60 * 1000  # processes compile at different speeds before they meet
# Engines built one after another in one job (a test builds several) each get their own key space; leader
# and followers count them alike because they build the same engines in the same order.
_engines = itertools.count()


def spans_processes(mesh) -> bool:
    """True when `mesh` holds devices of other processes (the engine must then lead or follow)."""
    if mesh is None:
        return False
    return any(device.process_index != jax.process_index() for device in mesh.devices.flat)


class Leader:
    """Publishes each dispatch of process 0's `Programs` to the followers (see the module docstring), and
    calls `on_lost(error)` once, from its watchdog thread, if a follower is lost."""

    def __init__(self, programs, on_lost):
        self._client = distributed.client()
        self._index = {key: str(index) for index, key in enumerate(programs.keys())}
        self._prefix = f"jaxstream/engine/{next(_engines)}"
        _check_in(self._client, self._prefix, programs)
        for index in _followers():
            theirs = self._client.blocking_key_value_get(f"{self._prefix}/programs/{index}", _POLL_MS)
            if theirs != repr(programs.keys()):
                raise ProcessGroupError(f"process {index} built other programs than process 0 ({theirs} vs "
                                        f"{programs.keys()!r}): every process must run the same model and config")
        self._number = 0
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, args=(on_lost,), name="jaxstream-multihost-watchdog",
                         daemon=True).start()

    def publish(self, key, batch) -> None:
        if self._stopped.is_set():
            raise ProcessGroupError("the multi-host engine's followers were released; it dispatches nothing more")
        name = f"{self._prefix}/dispatch/{self._number}"
        try:
            self._client.key_value_set(name, self._index[key])
            multihost_utils.broadcast_one_to_all(batch, is_source=True)
            self._client.key_value_delete(name)
        except Exception as exc:  # noqa: BLE001 - gloo and the coordination service raise JaxRuntimeError
            raise ProcessGroupError(f"the multi-host engine lost a process: {_first_line(exc)}") from exc
        self._number += 1

    def stop(self) -> None:
        """Releases the followers (their `follow` returns); called once the leader dispatches no more."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self._client.key_value_set(f"{self._prefix}/dispatch/{self._number}", _STOP)
        except Exception as exc:  # noqa: BLE001 - a follower already gone needs no release
            logger.warning("could not release the followers: %s", _first_line(exc))

    def _watch(self, on_lost) -> None:
        last = {index: (None, time.monotonic()) for index in _followers()}
        while not self._stopped.wait(_HEARTBEAT_S):
            now = time.monotonic()
            for index, (count, since) in last.items():
                try:
                    current = self._client.key_value_try_get(f"{self._prefix}/alive/{index}")
                except Exception:  # noqa: BLE001 - not found: a follower that never beat is as silent
                    current = count
                if current != count:
                    last[index] = (current, now)
                elif now - since > LOST_AFTER_S:
                    logger.error("process %d sent no heartbeat for %.0f s: the multi-host engine stops", index,
                                 now - since)
                    on_lost(ProcessGroupError(f"the multi-host engine lost a process: process {index} sent no "
                                              f"heartbeat for {LOST_AFTER_S:g} s"))
                    return


def follow(programs) -> int:
    """A follower's loop: runs every program the leader dispatches, in its order, until the leader stops.
    Returns the number of dispatches run. `programs` must come from the same build as the leader's."""
    client = distributed.client()
    prefix = f"jaxstream/engine/{next(_engines)}"
    stopped = threading.Event()
    beat = threading.Thread(target=_beat, args=(client, f"{prefix}/alive/{jax.process_index()}", stopped),
                            name="jaxstream-multihost-heartbeat", daemon=True)
    beat.start()
    try:
        _check_in(client, prefix, programs)
        keys = programs.keys()
        logger.info("following the leader's dispatches (%d programs)", len(keys))
        for number in itertools.count():
            header = _wait(client, f"{prefix}/dispatch/{number}")
            if header == _STOP:
                logger.info("the leader stopped after %d dispatches", number)
                return number
            key = keys[int(header)]
            batch = multihost_utils.broadcast_one_to_all(programs.empty_batch(key), is_source=False)
            programs.run(key, batch)  # host copies of the leader's batch
    finally:
        stopped.set()


def _followers() -> range:
    return range(1, jax.process_count())


def _check_in(client, prefix: str, programs) -> None:
    """Publishes the programs this process compiled, then waits until every process of the job has."""
    client.key_value_set(f"{prefix}/programs/{jax.process_index()}", repr(programs.keys()))
    try:
        client.wait_at_barrier(f"{prefix}/ready", _READY_TIMEOUT_MS)
    except Exception as exc:  # noqa: BLE001 - a process that never built its engine, or died building it
        raise ProcessGroupError(f"the processes of the multi-host engine did not all start: {_first_line(exc)}"
                                ) from exc


def _beat(client, name: str, stopped: threading.Event) -> None:
    while not stopped.wait(_HEARTBEAT_S):
        try:
            client.key_value_increment(name, 1)
        except Exception:  # noqa: BLE001 - the leader is gone; JAX ends this process
            return


def _wait(client, name: str) -> str:
    """The value of `name` once the leader sets it, however long that takes."""
    while True:
        try:
            return client.blocking_key_value_get(name, _POLL_MS)
        except Exception as exc:  # noqa: BLE001 - a timeout: wait again; anything else ends the follower
            if "DEADLINE_EXCEEDED" not in str(exc):
                raise ProcessGroupError(f"the multi-host engine lost its leader: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def follow_pretrained(model_source, engine_cfg, *, dtype=None) -> int:
    """`follow` for the engine process 0 builds with `AsyncEngine.from_pretrained(model_source, engine_cfg)`:
    the same model shards, the same programs in the same order."""
    from jaxstream.engine import builders

    model, tokenizer, eos_ids = builders.load_pretrained(model_source, engine_cfg, dtype=dtype)
    return follow(builders.build_core(model, engine_cfg, tokenizer=tokenizer, eos_token_id=eos_ids).programs)

"""Items the engine thread hands to the event loops that wait for them: a stream's outputs, an idle waiter's
wake-up, the error that ends every stream when the engine stops. Each loop gets one callback per batch, so a tick
that produced outputs for many streams costs each loop one wake-up."""
import logging

logger = logging.getLogger(__name__)


def post_to_loops(items) -> None:
    """Hands (loop, target, item) triples to their event loops (`target.put_nowait(item)` there)."""
    by_loop: dict = {}
    for loop, target, item in items:
        by_loop.setdefault(loop, []).append((target, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening any more


def _put_all(batch) -> None:
    for target, item in batch:
        try:
            target.put_nowait(item)
        except Exception:  # noqa: BLE001 - one stream's failure must not lose the other streams' items
            logger.exception("delivering an engine output to its stream failed")


class ResolveOnPut:
    """A target that resolves `future` on its first item (an idle waiter)."""

    def __init__(self, future):
        self._future = future

    def put_nowait(self, _) -> None:
        if not self._future.done():
            self._future.set_result(None)

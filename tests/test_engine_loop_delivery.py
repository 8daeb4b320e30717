"""engine/loop_delivery.py: the engine thread's items reach their event loops in batches."""
import asyncio
import logging

from jaxstream.engine.loop_delivery import post_to_loops


class Broken:
    def put_nowait(self, item):
        raise RuntimeError(f"cannot take {item}")


async def test_a_target_that_raises_loses_no_other_item_of_its_batch(caplog):
    """One loop callback carries a tick's items for every stream on that loop: a target that raises (a bug in
    one stream's handling) used to drop every item after it in the batch, and those streams waited forever."""
    loop = asyncio.get_running_loop()
    first, last = asyncio.Queue(), asyncio.Queue()
    with caplog.at_level(logging.ERROR, logger="jaxstream.engine.loop_delivery"):
        post_to_loops([(loop, first, 1), (loop, Broken(), 2), (loop, last, 3)])
        assert await asyncio.wait_for(first.get(), 5) == 1
        assert await asyncio.wait_for(last.get(), 5) == 3
    assert any("cannot take 2" in (r.exc_text or "") for r in caplog.records), caplog.records

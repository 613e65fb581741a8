"""An asyncio loop on its own thread, for I/O that must keep its schedule while decisions run.

The signal tasks (probes, scrapes) and the KV-event subscribers each run on one, so a slow
decision on the router's loop never delays them; their results go back to the router's loop,
where all fleet-state writes happen.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=self.name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the thread's loop and wait for it from the caller's loop."""
        assert self.loop is not None, f"{self.name}: start() first"
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def stop(self) -> None:
        """Stop the loop (after the caller's own cleanup coroutine ran on it) and join."""
        if self._thread is None or self.loop is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 5)
        self.loop.close()
        self._thread = None

"""One engine thread serving every request: the bridge between asyncio handlers and the synchronous engine.

The engine is not thread-safe, so only the engine thread touches it. Handlers send it
commands (add, abort, stop) through a queue; between steps it applies them, and it steps
while any request is unfinished, so requests join and leave the running batch at every
step (continuous batching). Each request's outputs go to that request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from runtime.engine import Engine, Prompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server import memory
from runtime.server.metrics import ServingStats
from runtime.server.protocol import InvalidField

logger = logging.getLogger("tandem")


class QueueFull(Exception):
    """The waiting queue is at its limit (HTTP 503)."""


class EngineStopped(Exception):
    """The engine thread has stopped, or is stopping (HTTP 503)."""


class EngineFailed(Exception):
    """An error inside the engine failed this request (HTTP 500)."""


class RequestHandle:
    """One request's outputs as they arrive; `abort()` when the consumer leaves before the end."""

    def __init__(self, owner: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Resolved by the engine thread: None once the engine holds the request, or the reason it refused it.
        self.accepted: asyncio.Future[None] = loop.create_future()

    # The two calls the engine thread makes.

    def settle(self, error: Exception | None) -> None:
        self._call_soon(self._settle, error)

    def deliver(self, item: RequestOutput | BaseException) -> None:
        self._call_soon(self._queue.put_nowait, item)

    def _call_soon(self, callback: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone, and nobody is listening

    def _settle(self, error: Exception | None) -> None:
        # The handler awaiting `accepted` may have been cancelled in the meantime.
        if not self.accepted.done():
            if error is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(error)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def result(self) -> RequestOutput:
        last = None
        async for output in self:
            last = output
        assert last is not None and last.finished, "a request ended without a finished output"
        return last

    def abort(self) -> None:
        """Abort the request unless it has finished; its pages are freed at the engine's next turn."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int):
        assert max_waiting >= 0
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats = ServingStats(engine.stats())
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # Taken to send a command and to stop, so that no command arrives after the last drain.
        self._lock = threading.Lock()
        self._stopped = False
        # Touched by the engine thread only.
        self._handles: dict[str, RequestHandle] = {}
        self._rejected = 0
        self._failed = 0
        # Set when a request finishes; the allocator's freed memory goes back to the system once idle.
        self._trim_when_idle = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    # Called from the event loop ---------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def start(self) -> None:
        self._publish_stats()
        self._thread.start()

    async def stop(self, timeout: float = 60.0) -> None:
        """Abort every unfinished request and let the engine thread exit."""
        self.send(None)
        await asyncio.to_thread(self._thread.join, timeout)
        assert not self._thread.is_alive(), f"the engine thread did not stop within {timeout} s"

    def abort(self, request_id: str) -> None:
        """Abort one request (if the engine still holds it) at the engine thread's next turn."""
        self.send(partial(self._abort, request_id))

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight; each one's consumer gets EngineStopped(reason)."""
        self.send(partial(self._abort_all, EngineStopped(reason)))

    async def call(self, function: Callable[[], object]) -> object:
        """Run `function` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(error: Exception | None, result: object) -> None:
            if not done.done():  # the awaiting handler may have been cancelled
                done.set_exception(error) if error is not None else done.set_result(result)

        def command() -> None:
            error, result = None, None
            try:
                result = function()
            except Exception as err:
                error = err
            try:
                loop.call_soon_threadsafe(settle, error, result)
            except RuntimeError:
                pass  # the event loop is closed: nobody is waiting

        if not self.send(command):
            raise EngineStopped("the server is shutting down")
        return await done

    def send(self, command: Callable[[], None] | None) -> bool:
        """Queue a command for the engine thread; False once it has stopped taking them."""
        with self._lock:
            if self._stopped:
                return False
            self._commands.put(command)
            return True

    async def add(self, prompt: Prompt, params: SamplingParams, request_id: str, stream: bool,
                  lora_request: Any = None) -> RequestHandle:
        """Queue a request; ValueError (a bad prompt) and QueueFull are raised here, before any output."""
        handle = RequestHandle(self, request_id, asyncio.get_running_loop())
        if not self.send(partial(self._add, handle, prompt, params, stream, lora_request)):
            raise EngineStopped("the server is shutting down")
        try:
            await handle.accepted
        except asyncio.CancelledError:
            handle.abort()
            raise
        return handle

    # The engine thread ------------------------------------------------------------------------

    def _add(self, handle: RequestHandle, prompt: Prompt, params: SamplingParams, stream: bool,
             lora_request: Any = None) -> None:
        try:
            if self._stopped:
                raise EngineStopped("the server is shutting down")
            self._check_waiting(params.n)
            self._check_token_ids(params)
            self.engine.add_request(prompt, params, handle.request_id, stream=stream, lora_request=lora_request)
        except Exception as err:
            handle.settle(err)
            return
        self._handles[handle.request_id] = handle
        handle.settle(None)

    def _check_waiting(self, n: int) -> None:
        """Room in the waiting queue for the request's `n` sequences, each of which waits on its own."""
        if 0 < self.max_waiting < n:
            raise InvalidField(f"n: {n} choices, more sequences than may ever wait at once (the server's "
                               f"--max-waiting limit of {self.max_waiting})", "n")
        if self.engine.stats().num_waiting + n > self.max_waiting:
            self._rejected += 1
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences, the --max-waiting limit); "
                            "retry later")

    def _check_token_ids(self, params: SamplingParams) -> None:
        # The sampler indexes the logits with these ids: one outside the vocabulary would fail the step
        # for every request in it. The engine checks them too; here the error names the request's field.
        vocab = self.engine.vocab_size
        for name, ids in params.token_ids_to_check().items():
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidField(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", name)
        try:
            params.check_some_token_allowed(self.engine.eos_token_ids)
        except ValueError as err:
            raise InvalidField(str(err), "allowed_token_ids") from None

    def _abort(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def _run(self) -> None:
        try:
            while self._apply_commands(block=self._idle()):
                self._publish_stats()
                if self.engine.has_unfinished():
                    self._step()
        except BaseException:
            logger.exception("the engine loop stopped on an error")
        finally:
            with self._lock:
                self._stopped = True
            self._abort_all(EngineStopped("the server is shutting down"))
            self._drain()
            self._publish_stats()

    def _idle(self) -> bool:
        """True when there is nothing to step; first hands what the allocator holds free back to the system."""
        if self.engine.has_unfinished():
            return False
        if self._trim_when_idle:
            self._trim_when_idle = False
            memory.trim()
        return True

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once a stop was asked for."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _drain(self) -> None:
        """Run what was queued before the stop: adds are refused, aborts find nothing left to abort."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                command()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:
            # The step ran every scheduled request together, so there is no telling which one broke it:
            # each request in flight fails, and the loop goes on serving new ones.
            logger.exception("an engine step failed; failing the %d requests in flight", len(self._handles))
            self._failed += len(self._handles)
            self._abort_all(EngineFailed(f"the engine failed while running this request: {type(err).__name__}"))
            return
        # Stats first: a client that has its final output finds its pages already counted free.
        self._publish_stats()
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if output.finished:
                self._handles.pop(output.request_id, None)
                self._trim_when_idle = True
            if output.error is not None:
                # This request alone failed (in its own sampling or post-processing); the others went on.
                self._failed += 1
                item = EngineFailed(f"the engine failed while running this request: {output.error}")
            else:
                item = output
            if handle is not None:
                handle.deliver(item)

    def _abort_all(self, error: Exception) -> None:
        # Every request the engine holds came through `_add`, and has a handle until it finishes.
        for request_id in self._handles:
            self.engine.abort(request_id)
        self._publish_stats()
        for handle in self._handles.values():
            handle.deliver(error)
        self._handles.clear()

    def _publish_stats(self) -> None:
        # One assignment, so that the event loop always reads a consistent snapshot.
        self.stats = ServingStats(self.engine.stats(), rejected=self._rejected, failed=self._failed)

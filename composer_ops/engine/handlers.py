"""A worker's handlers: registering one per task name, and calling one for an attempt
(what it returns or raises, as the attempt's result)."""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from composer_ops.engine.attempt import describe
from composer_ops.engine.jsonvalues import check_json
from composer_ops.errors import Invalid, NonRetryableError

if TYPE_CHECKING:
    from composer_ops.engine.attempt import TaskContext

log = logging.getLogger("composer_ops.engine.worker")

Handler = Callable[[Any, "TaskContext"], Any]


def named(fn: object) -> str:
    """A handler as an error names it: its module and qualified name."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def check_free(handlers: MutableMapping[str, Handler], name: str) -> None:
    """``name`` has no handler yet (a second is refused, not silently put in the first
    one's place)."""
    if name in handlers:
        raise Invalid(f"task {name!r} has a handler already: {named(handlers[name])}")


def register(handlers: MutableMapping[str, Handler], name: str, fn: object) -> None:
    """Add ``fn`` as the handler of task ``name``: a callable, the name's first."""
    if not callable(fn):
        raise Invalid(f"the handler of task {name!r} must be a function (input, ctx), got {fn!r}")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        raise Invalid(f"the handler of task {name!r} is an async function ({named(fn)}): a worker runs its handlers "
                      f"in threads and takes what they return; give a plain function (one that awaits can "
                      f"call asyncio.run)")
    check_free(handlers, name)
    handlers[name] = fn


def call(fn: Handler, name: str, input: Any, ctx: TaskContext) -> tuple[str, Any, bool]:
    """Run handler ``fn`` of task ``name``: ("completed", its output, True), or
    ("failed", the error, whether it may be retried)."""
    try:
        output = fn(input, ctx)
    except NonRetryableError as exc:
        return "failed", describe(exc), False
    except Exception as exc:
        log.debug("handler %s raised: %s", name, traceback.format_exc())
        return "failed", describe(exc), True
    except BaseException as exc:    # SystemExit, KeyboardInterrupt raised by the handler's own code
        # A handler cannot stop its worker: in its slot's thread this would end the
        # thread and leave the slot's next tasks held, their leases renewed, never run.
        log.warning("handler %s raised %s; its attempt fails (a handler cannot stop its worker)",
                    name, type(exc).__name__)
        return "failed", describe(exc), True
    if inspect.isawaitable(output):     # an async callable registration could not see (a partial, a wrapper)
        if inspect.iscoroutine(output):
            output.close()              # never awaited: closed, not warned about at garbage collection
        return "failed", (f"handler {name!r} returned an awaitable ({type(output).__name__}), not its output: "
                          f"async handlers are not supported (give a plain function)"), False
    try:
        check_json(output, f"output of handler {name!r}")
    except Invalid as exc:
        return "failed", str(exc), False
    return "completed", output, True

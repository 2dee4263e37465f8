"""``EventOverlap``: DeepEP's handle for "wait until that communication finished", valid on every backend.

On CUDA it wraps a ``torch.cuda.Event`` recorded on the stream that did the work, and ``current_stream_wait``
makes the caller's current stream wait on it. Where no streams exist (CPU, gloo) or the strategy finished the
work synchronously, it holds no event and waiting is a no-op: results are already usable.
"""

from __future__ import annotations

from typing import Any


class EventOverlap:
    """A completion marker for one dispatch/combine call.

    Parameters
    ----------
    event : torch.cuda.Event or None
        Recorded after the communication; None when the work is already complete.
    extra_tensors : tuple of Tensor or None
        Tensors kept alive until the event is waited on (the caller may drop its own references).
    """

    def __init__(self, event: Any = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event; a no-op when there is no event."""
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.current_stream_wait()

    @staticmethod
    def capture(device: Any = None) -> EventOverlap:
        """An event recorded on the current CUDA stream, or an empty (already complete) one without CUDA."""
        import torch

        if device is not None and torch.device(device).type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return EventOverlap(event)
        return EventOverlap(None)

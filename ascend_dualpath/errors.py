"""The library's exceptions.

Every error the emulated device raises maps to one of these classes (the C++ runtime throws typed
exceptions that ``_C`` translates into them), so callers can catch a precise failure. Each also
derives from the closest builtin so generic handlers keep working. Messages name the offending value
and the limit it broke.
"""

from __future__ import annotations


class AdpError(RuntimeError):
    """Base class of every ascend_dualpath error."""


class BoundsError(AdpError, IndexError):
    """An address range falls outside a registered region or buffer."""


class AccessDenied(AdpError, PermissionError):
    """A region's access flags forbid the operation (e.g. remote write without REMOTE_WRITE)."""


class InvalidKey(AdpError, KeyError):
    """An lkey/rkey (or other handle) names no live registration."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NotRegistered(AdpError, LookupError):
    """Memory was used for a transfer without being registered."""


class AlignmentError(AdpError, ValueError):
    """A length or address breaks an alignment rule (e.g. 32-byte DataCopy)."""


class PayloadTooLarge(AdpError, ValueError):
    """A payload exceeds a hardware or buffer limit."""


class EmptyTransfer(AdpError, ValueError):
    """A transfer of zero bytes was requested."""


class CapacityError(AdpError, MemoryError):
    """A buffer, queue or core budget is too small for the request (UB overflow, SQ depth, ...)."""


class ConfigError(AdpError, ValueError):
    """A configuration value is out of its documented range."""


class QueueError(AdpError):
    """A queue pair or completion queue is in a state that forbids the operation (e.g. ERROR)."""


class ProtocolError(AdpError):
    """A device-side protocol rule was broken (doorbell before flush, wrong owner bit, ...)."""


class WaitTimeout(AdpError, TimeoutError):
    """A bounded wait expired; the message says what was awaited and the state last seen."""


class BackendUnavailable(AdpError):
    """The requested backend cannot run here; the message says why."""


class DeviceError(AdpError):
    """A device runtime or collective-library call (ACL, HCCL) returned an error code; the message names the
    call, the code's name and value, and what was asked of it."""


class StorageReadError(OSError, AdpError):
    """A KV block could not be read from the block store (missing block, I/O error, short or malformed file).

    OSError comes first so that ``StorageReadError(errno, message)`` fills ``.errno`` like any OSError.
    """


class ChecksumMismatch(StorageReadError):
    """A block's bytes do not match the checksum written with it; the destination buffer was left as it was."""


class AdmissionDeferred(WaitTimeout):
    """A host buffer could not admit an allocation before its deadline (back-pressure: retry later or elsewhere)."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument has the wrong Python type; the message names the argument and the type received.

    A ConfigError (the argument is out of its documented domain) and a TypeError (generic handlers keep working).
    """

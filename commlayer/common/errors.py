"""Exceptions raised by commlayer; each subclasses the builtin a Horovod user expects."""

from __future__ import annotations


class CommlayerError(RuntimeError):
    """Base class of commlayer's runtime errors (Horovod: HorovodInternalError)."""


# Horovod users catch this name (elastic training, error handling).
HorovodInternalError = CommlayerError


class ConfigError(ValueError):
    """A COMMLAYER_* environment variable or explicit setting has a bad value."""


class NotInitializedError(ValueError):
    """A collective was called before commlayer.init() or after shutdown()."""


class DuplicateNameError(ValueError):
    """Two in-flight operations on one rank share a name."""


class UnsupportedOpError(ValueError, RuntimeError):
    """A reduce op this collective does not take (reducescatter with op=Adasum): a bad argument
    (ValueError), which horovod.torch code catches as the RuntimeError Horovod raises."""


class TensorMismatchError(CommlayerError):
    """Ranks submitted the same tensor name with different shape, dtype, op or root."""


class StallError(CommlayerError):
    """Some ranks of a process set never submitted a tensor the others are waiting on."""


class ShutdownError(CommlayerError):
    """The engine stopped (a rank shut down, died, or failed) before the operation completed."""


class RankDiedError(ShutdownError):
    """A peer process exited while the others still needed it."""


class CollectiveTimeoutError(ShutdownError):
    """A collective (or the negotiation) made no progress for ``collective_timeout_s``: a peer
    on another host is gone, stopped or cut off. The job aborts after it (MPI_Abort)."""


class PayloadError(CommlayerError):
    """A compressed payload received from a peer is malformed (wrong length, index out of
    range, non-finite scale): decoding it would silently corrupt the gradient."""


class SpecError(ValueError):
    """An oracle input (a .net, .plat or .lc file, or a model description) is malformed; the
    message names the file and line."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: hosts were added or removed; ``commlayer.elastic.run`` catches it,
    runs the reset callbacks and calls the training function again (Horovod's name)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(
            "hosts were updated" + (" (removed only: state sync skipped)" if skip_sync else "")
        )
        self.skip_sync = skip_sync


class ShardStoreError(CommlayerError):
    """A shard store (commlayer.data) cannot be read or written: the message names the rank and
    the file."""


class ShuffleMismatchError(CommlayerError):
    """Ranks built a PartialLocalShuffler with different settings (fraction, seed, chunks) or
    with stores that overlap: the message names the ranks and their values."""

"""Backends: point-to-point and collective transport under the engine (mpi, loopback)."""

from commlayer.backends.base import Backend, Request

__all__ = ["Backend", "Request"]

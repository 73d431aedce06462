"""Restart commlayer inside a test session, on every rank together (init() reads the
environment and its keywords once: a test that needs other settings starts it again)."""

from __future__ import annotations

from typing import Any

import commlayer as cl


def reinit(**settings: Any) -> None:
    """Shut commlayer down on every rank and start it again with ``settings``."""
    cl.barrier()
    cl.shutdown()
    cl.init(**settings)

"""Registries: the names each setting may take, collected from the modules that own them.

config.py checks a setting that names an algorithm, a sparse algorithm, a backend, a kernel
implementation, a compressor or a topology against the :class:`Validator`
given here, and imports none of those modules (they sit above it). ``REGISTRIES`` goes to
``config.load(registries=...)`` from ``init()``, the launcher and the CLI; core/runtime.py also
installs it as config's default, for ``config.load()`` and ``config.override()`` called bare.
Names are asked for at each check, so an algorithm or compressor registered later is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from commlayer import algorithms, backends, compression, kernels
from commlayer.algorithms import sparse
from commlayer.common import topology
from commlayer.common.config import InvalidValue, Registries, Validator, one_of
from commlayer.costmodel import simulated


def _names(choices: Callable[[], Sequence[str]]) -> Validator:
    """One of ``choices()``, case and surrounding spaces ignored."""
    return Validator(one_of(choices), lambda: f"one of {', '.join(choices())}")


def _topology(text: str) -> str:
    text = text.strip()
    if text:
        topology.parse(text)  # ValueError on a bad part
    return text


def _sim_table(text: str) -> str:
    """COMMLAYER_SIM_TABLE: its files read and checked now (costmodel/simulated.py), so a
    missing or malformed one is named at init(), not at the first allreduce."""
    text = text.strip()
    if text:
        try:
            simulated.load(text)
        except ValueError as exc:
            raise InvalidValue(str(exc)) from None
    return text


# One per config.REGISTERED_FIELDS (tests/unit/test_config_consumers.py checks the two agree).
REGISTRIES: Registries = {
    "allreduce_algorithm": Validator(
        lambda text: algorithms.canonical(one_of(algorithms.accepted)(text)),
        lambda: f"one of {', '.join(algorithms.available())} (mpi: native's former name)",
    ),
    "sparse_algorithm": _names(sparse.available),
    "backend": _names(backends.available),
    "kernels": _names(lambda: kernels.CHOICES),
    "compression": Validator(compression.check_spec, compression.spec_help),
    "topology": Validator(
        _topology,
        lambda: "comma-separated nodes=N, local=L, torus=RxC (e.g. nodes=2,local=2)",
    ),
    "sim_table": Validator(
        _sim_table,
        lambda: (
            "JSON-lines files of `commlayer simulate --format json` (joined by ':') of one machine"
        ),
    ),
}

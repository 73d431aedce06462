"""Cost model of the allreduce algorithms, calibrated on this machine; it decides ``auto``.

Its parts: model.py, the alpha-beta-gamma sums of a schedule (pure: every registered schedule
algorithm is costed from its steps, so a new one needs no table); sparse.py, the same for the
sparse algorithms (and sparse ``auto``'s pick); compressed.py, a compressed bucket's cost;
calibration.py, the stored ``Calibration``; simulated.py, COMMLAYER_SIM_TABLE as ``auto`` reads
it. The package sits above the algorithms and compressors it costs and below what decides by it
(core/selection.py, the engine's allreduce; DESIGN.md's layers). Measuring a
calibration needs a backend and the executor: it is a side system the runtime never imports,
``commlayer.launch.calibrate``. ``commlayer calibrate`` (under mpiexec) measures and saves;
``commlayer algorithms --size 64MiB`` prints the predicted table. The names below are
re-exported from model.py and calibration.py.
"""

from __future__ import annotations

from commlayer.costmodel.calibration import (
    Calibration,
    default_path,
    from_bytes,
    load,
    load_all,
    save,
    to_bytes,
)
from commlayer.costmodel.model import (
    HEURISTIC_SHM_BYTES,
    SCHEDULE_MARGIN,
    Sharing,
    Simulated,
    candidates,
    choose,
    local_time,
    message_time,
    node_major,
    predict,
    ranked,
    schedule_time,
    step_time,
    table,
)
from commlayer.costmodel.model import _link_sharing as _link_sharing  # read by the unit tests

__all__ = [
    "HEURISTIC_SHM_BYTES",
    "SCHEDULE_MARGIN",
    "Calibration",
    "Sharing",
    "Simulated",
    "candidates",
    "choose",
    "default_path",
    "from_bytes",
    "load",
    "load_all",
    "local_time",
    "message_time",
    "node_major",
    "predict",
    "ranked",
    "save",
    "schedule_time",
    "step_time",
    "table",
    "to_bytes",
]

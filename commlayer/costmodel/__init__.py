"""Cost model of the allreduce algorithms, calibrated on this machine; it decides ``auto``.

Three parts: model.py, the alpha-beta-gamma sums of a schedule (pure: every registered schedule
algorithm is costed from its steps, so a new one needs no table); calibration.py, the stored
``Calibration``; measure.py, ``calibrate`` and the timing behind it (needs a backend and the
executor). ``commlayer calibrate`` (under mpiexec) measures and saves; ``commlayer algorithms
--size 64MiB`` prints the predicted table. The names below are re-exported from the three, so
``costmodel.X`` works for each.
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
from commlayer.costmodel.measure import (
    NATIVE_SIZES,
    calibrate,
    run_local_collective,
)
from commlayer.costmodel.measure import _fit as _fit  # private, read by the unit tests
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
    "NATIVE_SIZES",
    "SCHEDULE_MARGIN",
    "Calibration",
    "Sharing",
    "Simulated",
    "calibrate",
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
    "run_local_collective",
    "save",
    "schedule_time",
    "step_time",
    "table",
    "to_bytes",
]

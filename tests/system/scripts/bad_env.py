"""commlayer.init() with one bad COMMLAYER_* variable at a time must raise ConfigError on every
rank, before touching MPI; with the variable gone, init() then works."""

from __future__ import annotations

import json
import os
import sys

import _worker
import torch

import commlayer as hvd

_worker.start()
for name, value in json.loads(sys.argv[1]).items():
    os.environ[name] = value
    _worker.attempt("init", hvd.init, variable=name, value=value)
    del os.environ[name]
_worker.attempt("init_clean", hvd.init)
_worker.attempt("allreduce", lambda: hvd.allreduce(torch.ones(2), name="t", op=hvd.Sum))
hvd.shutdown()
_worker.report("done")

"""``commlayer calibrate`` as the console script runs it (arguments passed through)."""

from __future__ import annotations

import sys

import _worker

from commlayer import cli

_worker.start()
sys.exit(cli.main(["calibrate", *sys.argv[1:]]))

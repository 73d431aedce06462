"""``commlayerrun``'s old module path (it is commlayer/launch/launcher.py): ``python -m
commlayer.launcher`` and entry points installed before the move still run it."""

import sys

from commlayer.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())

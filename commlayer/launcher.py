"""``commlayerrun``'s old module path (it is commlayer/launch/launcher.py): ``import
commlayer.launcher`` gives that same module, and ``python -m commlayer.launcher`` and entry
points installed before the move still run it."""

import sys

from commlayer.launch import launcher as _launcher

if __name__ == "__main__":
    sys.exit(_launcher.main())
else:
    sys.modules[__name__] = _launcher

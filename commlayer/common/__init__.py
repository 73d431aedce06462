"""What every layer shares (DESIGN.md, the bottom of the layers): the settings (``config``,
the one reader of ``COMMLAYER_*``), the errors, the reduction operators and the machine's shape
(``topology``). These modules import nothing of commlayer outside this package, so every
package above, from the kernels to the API, may import them. (Named as Horovod's
``horovod/common``; ``commlayer.config``, ``commlayer.errors``, ``commlayer.reduce_ops`` and
their ``commlayer.core.*`` spellings are the same modules, commlayer/__init__.py.)"""

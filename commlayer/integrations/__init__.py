"""Integrations: commlayer's compressors under other frameworks' training loops.

``from commlayer.integrations import ddp``: a DistributedDataParallel communication hook
(``ddp.CommState``, ``ddp.hook``, ``ddp.compress_wrapper``). Built on commlayer's public API
(``commlayer.compression``) and ``torch.distributed`` only; nothing here reaches into the engine.
"""

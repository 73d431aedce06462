"""The core: one engine thread per process that negotiates, fuses, executes and completes the
operations the API layer submits (DESIGN.md). ``config``, ``errors``, ``reduce_ops`` and
``topology`` are the vocabulary every layer shares (settings, errors, reduction operators, the
machine's shape); they import nothing of commlayer but each other."""

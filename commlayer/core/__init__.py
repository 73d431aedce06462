"""The core: one engine thread per process that negotiates, fuses, executes and completes the
operations the API layer submits (DESIGN.md). It sits above the cost model, the algorithms, the
compressors, the backends and the kernels, and imports them; none of them imports it. The
vocabulary every layer shares (settings, errors, reduction operators, the machine's shape) is in
commlayer/common/."""

"""Simulation: commlayer's allreduce schedules replayed in SimGrid's SMPI at thousands of ranks.

The schedules are the ones the executor runs (algorithms/), exported per rank (export.py) and
replayed by a small MPI program built with smpicc (ext/sim/replay.c; smpi.py builds and runs
it) on a platform generated as SimGrid XML or given as a file (platforms.py). simulate.py puts
the simulated time beside the cost model's prediction; ``commlayer simulate`` (cli.py) prints
tables and plots (report.py). Needs SimGrid (``apt-get install libsimgrid-dev``:
smpicc, smpirun); nothing here is imported by the training path.
"""

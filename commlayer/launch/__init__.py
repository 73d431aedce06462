"""The processes and commands around a job, a side system that no worker's runtime imports:
``commlayerrun`` (launcher.py: mpiexec, the namespace cluster, Slurm), the elastic driver
(driver.py: discovery, rendezvous, blacklisting; server.py: its authenticated control channel),
host lists (hosts.py), MPICH's shared-memory leftovers (mpich_shm.py) and the calibration's
measuring (calibrate.py: ``commlayer calibrate``)."""

"""The benchmark (`hybridd bench`): hybridd against its peers and the hardware floor, in
parts (cli.py orders them; one module per part), over one timing library (timing.py), the
daemon it starts and stops (daemon.py, shared with the wire tools in scripts/), and the
random checkpoints it measures on (random_checkpoint.py, `python -m hybridd.bench.random_checkpoint`).

Nothing in the daemon imports this package: `hybridd start` pays nothing for it.
"""

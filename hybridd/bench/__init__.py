"""The benchmark (`hybridd bench`): hybridd against its peers and the hardware floor, in
parts (cli.py orders them; parts.py, peers.py and one module per part run them; report.py
writes the result), over one timing library (timing.py), the daemon under test and its
client (server.py, on daemon.py: the daemon it starts and stops, shared with the wire tools
in scripts/), and the random checkpoints it measures on (random_checkpoint.py,
`python -m hybridd.bench.random_checkpoint`).

Nothing in the daemon imports this package: `hybridd start` pays nothing for it.
"""

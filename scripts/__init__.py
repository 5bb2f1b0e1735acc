"""The tools users and maintainers run: the benchmark (`python -m scripts.bench`), the
wire fuzzer and load driver, the random-checkpoint and embedded-model tools, the demo.

A package so that its modules import each other by name (`scripts.timing`), never by
editing `sys.path`; every tool imports the installed `hybridd` and nothing of tests/.
"""

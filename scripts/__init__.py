"""The tools maintainers run beside the package: the wire fuzzer and load driver, the
request tracer, the embedded-model trainers, the demo. (The benchmark is `hybridd bench`,
in hybridd/bench/.)

A package so that its modules are run by name (`python -m scripts.fuzz_wire`), never by
editing `sys.path`; every tool imports the installed `hybridd` and nothing of tests/.
"""

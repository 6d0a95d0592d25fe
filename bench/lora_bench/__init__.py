"""The cluster benchmarks as packages: `fleet` (bench/bench_fleet.py: the router against
kube-proxy's spreading, on real or simulated pods) and `operator` (bench/bench_operator.py:
apply -> Ready, restart recovery, footprint, staging speed), both on the local cluster that
`cluster` starts and tears down. The scripts in bench/ are their command lines; bench/ is on
the path when they run (and for the tests, `tests.support.bench_module`).
"""

"""The fleet benchmark (bench/bench_fleet.py, whose docstring says what it measures and how):
what goes on the cluster (`objects`), the pods' counters (`counters`), one route's figures
(`tally`), the real pods' rounds (`rounds`) and report (`report`), the simulated fleet
(`simulated`), and the command line (`cli`)."""

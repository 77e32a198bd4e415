"""gpufrac benchmarks: `python -m bench` (make bench) writes bench/results/*.json."""

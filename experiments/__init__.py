"""Experiments: the simulated online-learning harness (`experiments.harness`), the pre-registered drift suite
(`experiments.suite`, its plan in experiments/suites/*.yaml, planning, reporting and replication), and the studies
that run the real pipeline or the harness to answer a question (stability, offpolicy,
sync_baselines, ...). Speed and memory micro-benchmarks live in bench/.

Each script runs as a module from the repository root, e.g. `.venv/bin/python -m experiments.suite --help`.
Experiments may import bench (bench.common: machine, JSON and figure helpers); bench never imports experiments, and
the product packages import neither (tests/test_import_graph.py).
"""

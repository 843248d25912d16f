"""Benchmarks of our runner against the ways people score without it (`python -m bench`).

See bench/README.md: named workloads (bench/workloads.py) on a random-weight Qwen3 model
directory or an existing one (bench/models.py), timed for each system (bench/ours.py,
bench/peers.py, bench/llamacpp.py) by bench/harness.py, checked against ours and printed by
bench/report.py.
"""

"""Baselines the tests and benchmarks measure against: all-resident TorchRec tables and
plain-Python cache simulators (LRU, LFU, Belady's MIN, a reference oracle)."""

"""`kvserve bench`: serving (online) and throughput (offline) benchmarks."""

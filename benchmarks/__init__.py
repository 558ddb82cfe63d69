"""Benchmarks: jobs-server against Ray's own job server on one cluster (`-m benchmarks.run`)."""

"""Load balancing, in every worker: each rank's step timed by phase, stragglers named, and
per-rank batch shares from measured speed (``balance.mode = "throughput"``)."""

"""Data, in every worker and ``dtrain prepare``: the sharded on-disk format, pure partition
plans from one global position, each rank's loader, streams read by source shard, and
language-model views."""

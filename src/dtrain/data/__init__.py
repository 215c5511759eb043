"""Data, in every worker and ``dtrain prepare``: the sharded on-disk format, pure partition
plans from one global position, each rank's loader, and language-model views."""

"""Data, in every worker and ``dtrain prepare``: the sharded on-disk format (local, or in an
object store read ahead into a bounded cache the ranks of a machine share), pure partition
plans from one global position, each rank's loader, streams read by source shard, and
language-model views."""

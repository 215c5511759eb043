"""Object storage, in every process that reads or writes a run folder or a dataset there: keys in
a store through fsspec (``s3://bucket/prefix``), each request under one retry policy, a failure
named as the store's (``objects``)."""

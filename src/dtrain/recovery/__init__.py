"""``fault.recovery = "inplace"``: a failed worker is replaced while the others keep their state
in memory. Nothing here runs under the default recovery (a restart from the last checkpoint).

The launcher's side: the ``coordinator`` that forms the membership generations (and, across
machines, watches each machine's workers), each machine's ``node_claim``; the worker's side:
``inplace`` (one generation's part, the trainer's one seam ``Trainer.recovery``), ``handover``
(a state sent to a joiner tensor by tensor), ``sever`` (a failed generation's connections shut);
both sides: ``membership`` (the generations' keys in the launcher's store), reached through
``dtrain.dist.store_link`` (bounded, reconnecting calls). The two processes' entries
of this mode sit with their process: ``dtrain.launch.launcher`` (its in-place layout) and
``dtrain.train.inplace_worker`` (a worker's loop over generations)."""

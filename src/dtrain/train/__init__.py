"""The worker's loop: the one wiring place, the trainer, its step, evaluation and NaN guard.

What every worker runs: ``job`` and ``wiring`` (a config and a task to a trainer), ``trainer``,
``step``, ``evaluation``, ``nan_guard``, ``optim_choice``, ``loss_contract``, ``profile``,
``config_agreement``; under ``fault.recovery = "inplace"``, ``inplace_worker`` (a trainer per
membership generation) and ``recovery_seam`` (the trainer's one seam to :mod:`dtrain.recovery`)."""

"""The worker's loop: the one wiring place, the trainer, its step, evaluation and NaN guard.

What every worker runs: ``job`` (the one wiring place: a config and a task to a trainer in a
process group that is up; the ranks agree on the run folder and the config, ``config_agreement``),
``trainer`` (the loop), ``step`` (a step's forward, loss and backward over its micro-batches, the
same for every strategy), ``evaluation``, ``nan_guard`` (a non-finite step: skip, or roll back),
``optim_choice`` (the task's optimizer and schedule or the config's), ``loss_contract`` (every
call of the task's loss checked), ``profile`` (``train.profile``: a torch.profiler trace of a
window of steps). ``inplace_worker``: a worker's loop over membership generations
under ``fault.recovery = "inplace"`` (a trainer per generation; :mod:`dtrain.recovery`)."""

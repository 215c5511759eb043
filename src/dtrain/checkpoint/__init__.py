"""Checkpoints: everything about the files a run saves and resumes from, in one package.

===============  ============================================================================
``layout``       the names: ``checkpoints/step-N/`` folders and the files in them
``write``        the :class:`~dtrain.checkpoint.write.Checkpointer`: snapshot, write, commit
``snapshot``     the CPU copy of a state that an asynchronous save writes while training goes on
``read``         find the newest folder that verifies, load files, check that a model fits
``safe_load``    what loading admits: tensors and plain data, never code (DCP's metadata too)
``safe_dcp``     DCP's reader and load planner for ``dcp/``, built on ``safe_load``
``resume``       which checkpoint a run resumes from, or the NaN guard rolls back to
``state``        :class:`~dtrain.checkpoint.state.TrainingState`: the parts a checkpoint holds
``forms``        the forms a strategy's state takes (replicated, per rank, sharded): no files
``model_state``  a strategy's named state dicts to their files, and any saved form into its own
``cross_form``   the conversions between forms, by parameter name
``rng``          every RNG's state (a part of each rank's checkpoint) and the run's seeding
``rundir``       the launcher's checks of a run folder before any worker starts
===============  ============================================================================

Nothing here imports a strategy, and no strategy opens a file: a strategy gives and takes its
model and optimizer state as named state dicts with their form
(:class:`~dtrain.checkpoint.model_state.ModelState`).
"""

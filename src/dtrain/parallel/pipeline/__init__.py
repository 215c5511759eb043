"""The ``pipeline`` strategy and what it alone needs: cutting a model into stages and choosing
where to cut.

============  ===============================================================================
``strategy``  :class:`~dtrain.parallel.pipeline.strategy.PipelineStrategy`: stages on
              consecutive ranks, torch's pipelining schedules, x data parallel on a 2-D mesh
``split``     a model as a chain of layers, cut into stages (full-model names kept)
``plan``      where to cut: manual boundaries, equal layer counts, or the stage balancer
``stages``    the exact stage partition of per-layer costs (pure)
``profile``   each layer's forward+backward time and memory on this job's own devices
``refine``    the partition corrected by timing the stages as cut
``batches``   a step's micro-batches as one batch for the schedule
``ties``      parameters stages share: their groups, summed gradients, norm counted once
============  ===============================================================================
"""

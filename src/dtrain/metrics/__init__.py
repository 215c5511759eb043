"""Metrics, in every worker: one stream of records to every sink (``metrics.jsonl``, the
progress line, TensorBoard, W&B and MLflow) and the run's summary, which :mod:`dtrain.report`
reads back; where ``train.profile``'s traces lie (``traces``)."""

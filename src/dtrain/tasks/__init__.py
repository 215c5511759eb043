"""Tasks dtrain ships, in every worker: the default job's task (``run.task``'s default)."""

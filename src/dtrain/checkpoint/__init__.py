"""Checkpoints: everything about the files a run saves and resumes from, in one package.

Nothing here imports a strategy, and no strategy opens a file: a strategy gives and takes its
model and optimizer state as named state dicts with their form
(:class:`~dtrain.checkpoint.model_state.ModelState`).
"""

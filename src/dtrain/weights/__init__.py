"""Weights in and out, in workers and ``dtrain export``: ``run.init_from``, exports, Hugging
Face configs.

A model's weights in and out of dtrain, apart from checkpoints (which are
:mod:`dtrain.checkpoint`'s)."""

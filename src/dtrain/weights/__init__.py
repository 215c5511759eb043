"""Weights in and out, in workers and ``dtrain export``: ``run.init_from``, exports, Hugging
Face configs.

A model's weights in and out of dtrain, apart from checkpoints (which are
:mod:`dtrain.checkpoint`'s): ``init_from`` (``run.init_from`` and ``dtrain.load_weights``:
files, Hugging Face folders, runs and checkpoints; the fit check), ``export`` (``dtrain
export``: a checkpoint's model as one file or a Hugging Face folder), ``model_config`` (a
Hugging Face model's config saved with its run, for that folder), ``adapters`` (PEFT adapters:
a base and an adapter in, an adapter folder or the merged model out)."""

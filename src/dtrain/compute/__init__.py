"""The model's numerics, in every worker and ``dtrain estimate``: what every strategy and the
step do the same way.

What is done to the user's model the same way under every strategy, below the strategies and
the loop that both use it: how a batch's inputs reach its forward (``model_call``), the autocast
context and fp16's loss scale (``precision``), the optimizer and its schedule (``optim``)."""

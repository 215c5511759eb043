"""The model's numerics, in every worker and ``dtrain estimate``: what every strategy and the
step do the same way.

Below the strategies and the loop that both use it: ``model_call`` (how a batch reaches the
forward), ``precision`` (autocast and fp16's loss scale), ``optim`` (optimizer and schedule)."""

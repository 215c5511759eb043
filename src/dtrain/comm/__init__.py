"""Communication: what it costs (``accounting``) and compressing it (``compression`` with its
hooks). The strategies that communicate less often, ``localsgd`` and ``diloco``, are strategies
like the others: :mod:`dtrain.parallel.local_sgd`. Nothing here imports :mod:`dtrain.parallel`,
which builds on this package."""

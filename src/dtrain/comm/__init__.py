"""Communication: what it costs (``accounting``), compressing it, and strategies that do less of
it (``local_sgd``: ``localsgd``, ``diloco``).

The strategy registry (:mod:`dtrain.parallel`) lists ``local_sgd``'s strategies, and those build
on ``dtrain.parallel.base``. Importing the registry here, before any module of this package,
lets ``import dtrain.comm.local_sgd`` work on its own: otherwise the registry would start
importing while ``local_sgd`` waits on it, and ask it for classes not defined yet.
"""

import dtrain.parallel  # noqa: F401  (see above)

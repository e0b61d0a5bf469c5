"""Tasks and environments from other libraries, each behind an optional extra.

Nothing here imports its library at import time: a module imports it when first used, and says
which extra to install (exit 2) when it is missing, so the core runs without any of them.

- :mod:`alignzoo.integrations.reasoning_gym`: reasoning-gym's procedural tasks as a data source
  (``data.train: {reasoning_gym: {...}}``) and their scorers (the ``reasoning_gym`` labeler).
"""

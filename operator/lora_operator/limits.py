"""The store's limits and their defaults: the largest adapter file a staging takes, and how many
stagings run at once.

Read by `config` (the flags' defaults) and `staging` (the `Store`'s), so that what reads the
operator's configuration (the router's does) never imports the store. Imports nothing.
"""

from __future__ import annotations

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_CONCURRENT = 4

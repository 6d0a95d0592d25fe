"""The store's limits and their defaults: the largest adapter file a staging takes, how many
stagings run at once, and how much of the volume one namespace's adapters may take.

Read by `edges.config` (the flags' defaults) and `staging` (the `Store`'s): the configuration
takes the defaults from here without loading the store's fetchers. Imports nothing.
"""

from __future__ import annotations

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_MAX_CONCURRENT = 4
# Ten adapters at the largest size (a rollout holds two revisions of one), hundreds of typical
# ones (SD 1.5 and SDXL LoRAs of 10-900 MB); under half the chart's default 50Gi claim, so that
# one namespace alone cannot fill it.
DEFAULT_NAMESPACE_QUOTA = 20 * 1024**3

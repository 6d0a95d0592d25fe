"""`python -m lora_devcluster.images` (what `make images` runs)."""

import sys

from lora_devcluster.images import cli

sys.exit(cli.main())

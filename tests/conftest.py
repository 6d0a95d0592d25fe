"""Settings shared by every test: keep diffusers' and transformers' chatter out of test output."""

from __future__ import annotations

import logging

logging.getLogger("diffusers").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)

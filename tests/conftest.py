"""Shared fixtures: tiny offline models and random adapters, built once per test session."""

from __future__ import annotations

import logging

logging.getLogger("diffusers").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)

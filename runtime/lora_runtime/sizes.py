"""Sizes with units, as the chart's values, the command lines and a PVC write them (pure).

`parse_size` is the one parser of `--max-adapter-bytes`, `--namespace-quota`, the router's
`--max-body-bytes` and the chart's size values; `argument` is it as an argparse `type`.
"""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

# Decimal (SI) and binary (IEC) multiples, and Kubernetes' quantity suffixes (Ki, Mi, Gi...), so
# a size reads the same in the chart's values, on the command line and in a PVC.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate("kmgt", 1)},
    **{p: 1000**i for i, p in enumerate("kmgt", 1)},
    **{f"{p}ib": 1024**i for i, p in enumerate("kmgt", 1)},
    **{f"{p}i": 1024**i for i, p in enumerate("kmgt", 1)},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in a size such as `2GiB`, `500MB`, `1.5Gi` or `2147483648` (pure).

    Units are case-insensitive: B, kB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and Kubernetes'
    Ki/Mi/Gi/Ti (powers of 1024), K/M/G/T (powers of 1000, as in a Kubernetes quantity). A
    fraction is rounded down to whole bytes. Raises ValueError saying what is accepted.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {text!r}: give a number of bytes with an optional unit, e.g. "
            "2147483648, 2GiB, 2Gi or 500MB (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, "
            "Ki, Mi, Gi, Ti)"
        )
    return int(Fraction(match.group(1)) * _SIZE_UNITS[unit])


def argument(text: str) -> int:
    """`parse_size` as an argparse `type`: a bad size is a usage error saying what is accepted."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e

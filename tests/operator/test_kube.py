"""The operator's timestamps in the API's formats (`kube.now_iso`)."""

from __future__ import annotations

import datetime
import re

from lora_operator import kube


def test_a_time_has_seconds_and_a_micro_time_microseconds() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", kube.now_iso())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", kube.now_iso(micro=True))


def test_an_offset_moves_the_time_forward() -> None:
    later = datetime.datetime.fromisoformat(kube.now_iso(90))
    now = datetime.datetime.now(datetime.UTC)
    assert 85 <= (later - now).total_seconds() <= 90

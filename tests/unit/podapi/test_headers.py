"""The headers of a generation's answer (`lora_podapi.headers`): the queue a pod counts on every
answer, and what made the images."""

from __future__ import annotations

import pytest
from lora_podapi import headers


@pytest.mark.parametrize(
    ("answered", "queue"),
    [
        ([("Content-Type", "application/json"), ("x-lora-queue", "3")], 3),
        ([("X-Lora-Queue", "0")], 0),
        ([("x-lora-model", "a")], None),  # an answer from a server that does not count it
        ([("x-lora-queue", "-1")], None),
        ([("x-lora-queue", "many")], None),
        ([("x-lora-queue", "³")], None),
    ],
    ids=["counted", "any-case", "absent", "negative", "not-a-number", "not-ascii"],
)
def test_the_queue_an_answer_reports(answered: list[tuple[str, str]], queue: int | None) -> None:
    assert headers.parse_queue(answered) == queue


def test_the_queue_and_what_served_parse_back() -> None:
    assert headers.parse_queue([(headers.QUEUE, headers.render_queue(5))]) == 5
    assert headers.served("base", None) == {"x-lora-model": "base"}
    assert headers.served("a", "0" * 64) == {"x-lora-model": "a", "x-lora-revision": "0" * 64}

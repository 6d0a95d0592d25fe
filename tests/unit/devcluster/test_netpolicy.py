"""`up`'s note on NetworkPolicy enforcement: what the nftables probe's outcomes mean."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from lora_devcluster import netpolicy


def runner(*rcs: int) -> Any:
    outcomes = list(rcs)

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert "--net" in argv
        return subprocess.CompletedProcess(argv, outcomes.pop(0), "", "Error: the reason")

    return run


@pytest.mark.parametrize(
    ("rcs", "expected"),
    [((0,), None), ((1, 0), "CONFIG_NFT_QUEUE"), ((1, 1), "nftables does not work here")],
    ids=["queue-works", "no-queue", "no-nftables"],
)
def test_the_probe_says_why_policies_are_not_enforced(
    rcs: tuple[int, ...], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(netpolicy.shutil, "which", lambda name: f"/usr/sbin/{name}")
    problem = netpolicy.enforcement_problem(runner(*rcs))
    assert problem is None if expected is None else expected in (problem or "")


def test_missing_tools_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netpolicy.shutil, "which", lambda name: None)
    assert "nft or unshare is missing" in (netpolicy.enforcement_problem() or "")

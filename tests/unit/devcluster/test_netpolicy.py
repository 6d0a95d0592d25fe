"""Whether the node can enforce NetworkPolicies: what the kernel probe's outcomes mean."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from lora_devcluster import netpolicy


def runner(rc: int, stderr: str = "") -> Any:
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        # Always in a throwaway network namespace: the host's ruleset is never touched.
        assert argv[:2] == ["unshare", "--net"]
        return subprocess.CompletedProcess(argv, rc, "", stderr)

    return run


def test_a_kernel_that_takes_the_rules_enforces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "lora_devcluster.netpolicy.shutil.which", lambda name, path=None: f"/usr/sbin/{name}"
    )
    assert netpolicy.enforcement_problem(runner(0)) is None


def test_a_refused_rule_is_reported_with_the_kernels_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "lora_devcluster.netpolicy.shutil.which", lambda name, path=None: f"/usr/sbin/{name}"
    )
    problem = netpolicy.enforcement_problem(runner(2, "ipset v7.17: Kernel error received"))
    assert problem is not None
    assert "not enforced" in problem and "Kernel error received" in problem


def test_missing_tools_are_named_with_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "lora_devcluster.netpolicy.shutil.which",
        lambda name, path=None: None if name == "ipset" else f"/usr/sbin/{name}",
    )
    problem = netpolicy.enforcement_problem(runner(0))
    assert problem is not None and "apt-get install ipset" in problem


def test_the_probe_covers_what_kube_router_writes() -> None:
    # The matches and targets of kube-router's policy chains (pkg/controllers/netpol).
    for word in ("ipset create", "--match-set", "physdev", "addrtype", "conntrack", "NFLOG"):
        assert word in netpolicy.PROBE, word

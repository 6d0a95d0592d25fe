"""Whether this machine's kernel could enforce NetworkPolicies on the local cluster.

kube-network-policies (the network-policy agent kind runs) judges the first packet of each
connection in user space: nftables hands it over with the `queue` statement, which needs the
kernel's nft_queue (`CONFIG_NFT_QUEUE`). Without it no agent of that design can run, and the
cluster's NetworkPolicies are accepted by the API server but enforce nothing. `up` says so.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

_TABLE = (
    "table inet lora_probe {{\n  chain c {{\n    type filter hook forward priority 0;\n"
    "    {rule}\n  }}\n}}\n"
)


def enforcement_problem(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> str | None:
    """Why NetworkPolicies cannot be enforced here, or None when the kernel has what it takes.

    Tries a rule with the `queue` statement in a throwaway network namespace (nothing of the
    host's ruleset is touched). `run` is subprocess.run, or a stand-in in tests."""
    nft, unshare = shutil.which("nft"), shutil.which("unshare")
    if nft is None or unshare is None:
        return "nft or unshare is missing (Debian: nftables, util-linux)"

    def accepted(rule: str) -> subprocess.CompletedProcess[str]:
        return run(
            [unshare, "--net", nft, "-f", "-"],
            input=_TABLE.format(rule=rule),
            capture_output=True,
            text=True,
            timeout=30,
        )

    try:
        if accepted("queue num 100 bypass").returncode == 0:
            return None
        control = accepted("counter")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the nftables probe could not run: {e}"
    if control.returncode != 0:
        return f"nftables does not work here ({control.stderr.strip()[:200]})"
    return (
        "the kernel has no nftables queue statement (CONFIG_NFT_QUEUE), which "
        "kube-network-policies needs to judge connections: NetworkPolicies are not enforced"
    )

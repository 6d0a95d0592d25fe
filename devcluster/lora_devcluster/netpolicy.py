"""Whether this machine's kernel can enforce NetworkPolicies on the local cluster.

The node enforces them with kube-router's network-policy controller alone (`--run-firewall`; no
routing, no service proxy: the bridge CNI and kube-proxy keep those jobs). It writes iptables
rules that match ipsets of pod addresses (`-m set`), bridged traffic (`-m physdev`), connection
state, the node's own addresses (`-m addrtype`), and logs drops with NFLOG. The probe tries one
rule with each of those in a throwaway network namespace (nothing of the host's, or of a
cluster's, ruleset is touched); the node starts the controller only when it passes, and `up`
prints the reason when it does not.

(kube-network-policies, what kind runs, was tried first: it hands each new connection to user
space with nftables' `queue` statement, and these machines' kernels have no `CONFIG_NFT_QUEUE`.)
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

# One ipset and one rule with every match and target kube-router's policy chains use.
PROBE = """\
set -e
ipset create lora-probe hash:ip timeout 0
iptables -w -N LORA-PROBE
iptables -w -A LORA-PROBE -m comment --comment probe -m set --match-set lora-probe src \
  -m physdev --physdev-is-bridged -m addrtype --src-type LOCAL \
  -m conntrack --ctstate RELATED,ESTABLISHED -m mark --mark 0x10000/0x10000 \
  -m limit --limit 10/minute --limit-burst 10 -j NFLOG --nflog-group 100
iptables -w -A LORA-PROBE -j MARK --set-xmark 0x10000/0x10000
iptables -w -A LORA-PROBE -p tcp -j REJECT --reject-with icmp-port-unreachable
"""

TOOLS = {"unshare": "util-linux", "ipset": "ipset", "iptables": "iptables"}


def enforcement_problem(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> str | None:
    """Why NetworkPolicies cannot be enforced here, or None when they can.

    `run` is subprocess.run, or a stand-in in tests."""
    path = "/usr/sbin:/sbin:/usr/bin:/bin"
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool, path=path) is None})
    if missing:
        return (
            f"NetworkPolicies are not enforced: missing {', '.join(missing)} "
            f"(run `make install`, or apt-get install {' '.join(missing)})"
        )
    try:
        done = run(
            ["unshare", "--net", "sh", "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": path, "LANG": "C.UTF-8"},
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"NetworkPolicies are not enforced: the kernel probe could not run: {e}"
    if done.returncode != 0:
        return (
            "NetworkPolicies are not enforced: the kernel refused an ipset or an iptables rule "
            "kube-router's policy controller needs (CONFIG_IP_SET, CONFIG_NETFILTER_XT_SET, "
            f"_MATCH_PHYSDEV, _MATCH_ADDRTYPE, _TARGET_NFLOG...): {done.stderr.strip()[-300:]}"
        )
    return None

"""`lora-devcluster up | exec | down | bin-dir | images`: the developer's local cluster.

Owns: argument parsing and what the user reads. Every action is in `cluster`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lora_devcluster import cluster, images, netpolicy, ns, registry


def _progress(message: str) -> None:
    print(f"lora-devcluster: {message}", file=sys.stderr, flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    c = cluster.up(args.dir, timeout=args.timeout, progress=_progress, with_registry=args.registry)
    d = str(c.dir)
    flag = "" if c.dir == cluster.default_dir().resolve() else f" --dir {d}"
    print(
        f"cluster ready in {d}\n"
        f"  kubeconfig: {c.kubeconfig} (the API server is https://127.0.0.1:6443 inside the\n"
        f"              cluster's network namespace; pods are 10.244.0.N, Services 10.0.0.N)\n"
        f"  use it:     lora-devcluster{flag} exec -- kubectl get pods -A\n"
        f"              lora-devcluster{flag} exec -- bash   # a shell with KUBECONFIG set\n"
        + (
            f"  registry:   {registry.ADDRESS} (plain HTTP; make push REGISTRY="
            f"{registry.ADDRESS}/lora-operator PLAIN_HTTP=1, inside exec)\n"
            if args.registry
            else ""
        )
        + f"  logs:       {c.layout.logs}/ (components), {c.layout.pod_logs}/ (containers)\n"
        f"  stop it:    lora-devcluster{flag} down"
    )
    problem = netpolicy.enforcement_problem()
    if problem is None:
        print("  policies:   NetworkPolicies enforced (kube-router's firewall)")
    else:
        print(f"  note:       {problem}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise cluster.ClusterError("nothing to run: lora-devcluster exec -- CMD [ARGS...]")
    c = cluster.find(args.dir.resolve())
    if c is None:
        raise cluster.ClusterError(f"no cluster running in {args.dir}; `lora-devcluster up` first")
    ns.setns(c.netns, ns.CLONE_NEWNET)
    os.execvpe(command[0], command, c.env())


def cmd_down(args: argparse.Namespace) -> int:
    was_running = cluster.down(args.dir)
    print("cluster stopped" if was_running else f"no cluster was running in {args.dir}; cleaned up")
    return 0


def cmd_bin_dir(args: argparse.Namespace) -> int:
    print(cluster.bin_dir())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-devcluster",
        description="A local single-node Kubernetes (control plane, containerd, kubelet, "
        "kube-proxy, CoreDNS) in private namespaces, running this project's images, for "
        "tests and the demo.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--dir",
            type=Path,
            default=cluster.default_dir(),
            help=f"cluster state directory (default {cluster.default_dir()})",
        )
        return p

    p = add("up", "start a cluster and wait until it is ready")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument(
        "--registry",
        action="store_true",
        help=f"also start an OCI registry at {registry.ADDRESS} that the node pulls from",
    )
    p.set_defaults(func=cmd_up)
    p = add("exec", "run a command in the cluster's network namespace with KUBECONFIG set")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)
    add("down", "stop the cluster and remove its processes, mounts and files").set_defaults(
        func=cmd_down
    )
    add("bin-dir", "print the directory holding kubectl, helm, ...").set_defaults(func=cmd_bin_dir)
    # Listed for --help; main() hands `images ...` to lora_devcluster.images' own parser.
    sub.add_parser("images", help="build or list the container images (`images -h`)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["images"]:
        sys.exit(images.main(argv[1:], prog="lora-devcluster images"))
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except cluster.ClusterError as e:
        print(f"lora-devcluster: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

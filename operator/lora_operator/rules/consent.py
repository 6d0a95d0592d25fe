"""What a LoRAAdapter may use to fetch its source: which Secret, which host, which address, and
whether the operator's own cloud identity signs for it (pure: no I/O, no clock, no kopf).

- A Secret lends its values to LoRAAdapters only when it says so: the label or annotation
  `lora.dev/source-credentials: "true"`. Any other Secret of the namespace (a ServiceAccount's
  token, a database password) is refused before a value is read into a request.
- `Rules.hosts`: the hosts sources (and every redirect they answer with) may name: an exact
  name, `*.example.com` for its subdomains, or `*` for any host. Empty: no remote host at all,
  only paths on the volume.
- `Rules.insecure_registries`: the OCI registries (`host:port`) oci:// sources may reach over
  plain HTTP (a cluster's own registry), and their token services; every other one is https.
- `Rules.ambient`: the namespaces whose s3:// sources without keys may be signed with the
  operator's own cloud identity (`*`: every namespace); elsewhere such a request goes unsigned.
- Addresses (`connect_refusal`): every address a source's host resolves to is checked before
  the operator connects to it. The Kubernetes API server and the cloud metadata addresses
  (link-local) are refused whatever the rules say; loopback, private, CGNAT, multicast,
  unspecified and reserved ranges, in any IPv6 form that carries an IPv4 address, and the
  ranges in `Rules.refuse` are refused unless `Rules.allow` opens them: the most specific range
  that holds the address decides (on a tie, an allowed range opens a default one, and a range
  in `Rules.refuse` closes an allowed one).

`egress` resolves the names and connects (I/O); these functions decide.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from lora_operator.rules import errors

CONSENT_KEY = "lora.dev/source-credentials"
ANY_HOST = "*"
# The values that open what is refused, as the chart names them (and the operator's flags).
HOSTS_VALUE = "operator.sourceHosts (--source-host)"
ALLOW_VALUE = "operator.sourceAllowCIDRs (--source-allow-cidr)"
REFUSE_VALUE = "operator.sourceRefuseCIDRs (--source-refuse-cidr)"
INSECURE_VALUE = "operator.insecureRegistries (--insecure-registry)"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Link-local (IPv4 and IPv6; the cloud metadata services answer there) and AWS's IPv6 metadata
# address, refused whatever the rules say.
REFUSED_NETWORKS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n) for n in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")
)

# Refused unless `Rules.allow` opens them (a longer prefix there wins), each with what it is.
BLOCKED_RANGES: tuple[tuple[Network, str], ...] = tuple(
    (ipaddress.ip_network(n), what)
    for n, what in (
        ("0.0.0.0/8", "an unspecified address"),
        ("10.0.0.0/8", "a private address"),
        ("100.64.0.0/10", "a carrier-grade NAT address"),
        ("127.0.0.0/8", "a loopback address"),
        ("172.16.0.0/12", "a private address"),
        ("192.0.0.0/24", "a reserved address"),
        ("192.0.2.0/24", "a reserved (documentation) address"),
        ("192.88.99.0/24", "a reserved (6to4 relay) address"),
        ("192.168.0.0/16", "a private address"),
        ("198.18.0.0/15", "a reserved (benchmarking) address"),
        ("198.51.100.0/24", "a reserved (documentation) address"),
        ("203.0.113.0/24", "a reserved (documentation) address"),
        ("224.0.0.0/4", "a multicast address"),
        ("240.0.0.0/4", "a reserved or broadcast address"),
        ("::/128", "an unspecified address"),
        ("::1/128", "a loopback address"),
        ("64:ff9b:1::/48", "a private (local NAT64) address"),
        ("100::/64", "a reserved (discard) address"),
        ("2001::/23", "a reserved (IETF protocol) address"),
        ("2001:db8::/32", "a reserved (documentation) address"),
        ("fc00::/7", "a private address"),
        ("fec0::/10", "a private (site-local) address"),
        ("ff00::/8", "a multicast address"),
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")


class CredentialsRefused(errors.PermanentStagingError):
    reason = "SecretNotConsented"


class HostRefused(errors.PermanentStagingError):
    reason = "HostRefused"


@dataclass(frozen=True)
class Rules:
    hosts: tuple[str, ...] = ()  # empty: no remote host; "*": every host
    ambient: tuple[str, ...] = ("*",)  # namespaces whose s3:// may use the operator's identity
    allow: tuple[Network, ...] = ()  # ranges opened (an internal mirror, a test's 127.0.0.1)
    refuse: tuple[Network, ...] = ()  # ranges refused besides BLOCKED_RANGES (pods, Services)
    insecure_registries: tuple[str, ...] = ()  # host:port reached over plain HTTP (oci://)

    def ambient_for(self, namespace: str) -> bool:
        return "*" in self.ambient or namespace in self.ambient


def plain_http_allowed(host: str, port: int | None, rules: Rules) -> bool:
    """Whether an OCI registry (or its token service) at `host:port` may be reached over plain
    HTTP: only when `rules.insecure_registries` names it as `host:port` (or `host`, for port
    80) (pure)."""
    host = host.lower()
    names = {f"{host}:{port}"} if port is not None else set()
    if port in (None, 80):
        names.add(host)
    return any(entry.strip().lower() in names for entry in rules.insecure_registries)


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or single addresses) as networks (pure); raises ValueError saying what is wrong,
    host bits set included (`10.0.0.1/8` is a typo for `10.0.0.0/8`, not a range)."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip()))
        except ValueError as e:
            raise ValueError(f"{value!r} is not a CIDR range such as 10.0.0.0/8 ({e})") from e
    return tuple(networks)


def secret_consents(labels: Mapping[str, str], annotations: Mapping[str, str]) -> bool:
    """Whether a Secret lends its values to LoRAAdapter sources (pure)."""
    return any(str(m.get(CONSENT_KEY, "")).strip().lower() == "true" for m in (labels, annotations))


def check_secret(name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
    """Raise CredentialsRefused, saying what to add, unless the Secret consents."""
    if not secret_consents(labels, annotations):
        raise CredentialsRefused(
            f"Secret {name!r} (source.secretRef) does not consent to being used by "
            f"LoRAAdapters: label it {CONSENT_KEY}=true (kubectl label secret {name} "
            f"{CONSENT_KEY}=true), then apply the adapter again"
        )


def host_allowed(host: str, allowed: Collection[str]) -> bool:
    """Whether `host` matches the allowlist: an exact name, `*.domain` for its subdomains, or
    `*` for any host; an empty list allows none (pure)."""
    host = host.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.strip().lower().rstrip(".")
        if pattern == ANY_HOST:
            return True
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


def check_host(host: str, rules: Rules, what: str) -> None:
    if host_allowed(host, rules.hosts):
        return
    if not rules.hosts:
        raise HostRefused(
            f"{what}: the operator fetches from no remote host ({HOSTS_VALUE} is empty: paths "
            f"on the volume only); ask the platform team to list {host} there"
        )
    raise HostRefused(
        f"{what}: host {host} is not one the operator may fetch from "
        f"({', '.join(rules.hosts)}); ask the platform team to allow it ({HOSTS_VALUE})"
    )


def embedded_ipv4(address: Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 address carries, and the name of the form, or None (pure):
    IPv4-mapped (::ffff:a.b.c.d), IPv4-translated (::ffff:0:a.b.c.d), IPv4-compatible
    (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d), 6to4 (2002:AABB:CCDD::) and Teredo (its client)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped, "an IPv4-mapped form"
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _TRANSLATED:
        return low32, "an IPv4-translated form"
    if address in _NAT64:
        return low32, "a NAT64 form"
    if address in _COMPATIBLE and int(address) > 1:  # not :: nor ::1
        return low32, "an IPv4-compatible form"
    if address.sixtofour is not None:
        return address.sixtofour, "a 6to4 form"
    if address.teredo is not None:
        return address.teredo[1], "a Teredo form"
    return None


def _range_refusal(address: Address, rules: Rules) -> str | None:
    """What `address` is when a range refuses it, or None (pure): the most specific range of
    BLOCKED_RANGES, `rules.allow` and `rules.refuse` that holds it decides; on a tie,
    `rules.allow` wins over a blocked range and `rules.refuse` wins over `rules.allow`."""
    best: tuple[int, int, str | None] | None = None  # (prefix length, rank, why refused)
    candidates: list[tuple[Network, int, str | None]] = [
        (net, 0, what) for net, what in BLOCKED_RANGES
    ]
    candidates += [(net, 1, None) for net in rules.allow]
    candidates += [(net, 2, f"in {net}, a range the operator refuses") for net in rules.refuse]
    for net, rank, why in candidates:
        holds = net.version == address.version and address in net
        if holds and (best is None or (net.prefixlen, rank) > best[:2]):
            best = (net.prefixlen, rank, why)
    return None if best is None else best[2]


def _opener(why: str) -> str:
    if why.startswith("in "):  # one of the platform team's own refused ranges
        return f"remove it from {REFUSE_VALUE} or allow a narrower range with {ALLOW_VALUE}"
    return f"allow the range with {ALLOW_VALUE}"


def connect_refusal(
    host: str,
    port: int,
    addresses: Iterable[str],
    rules: Rules | None,
    api_addresses: Collection[str] = (),
    api_endpoints: Collection[tuple[str, int]] = (),
) -> str | None:
    """Why connecting to `port` at the resolved `addresses` of `host` is refused, or None when
    every one of them may be connected to (pure); the reason names the value that opens it.

    `api_addresses`: addresses that are the Kubernetes API server on every port (its Service's
    virtual IP); `api_endpoints`: (address, port) pairs where it listens on a shared host (the
    address the operator logs in to). An IPv6 form that carries an IPv4 address (mapped, NAT64,
    6to4...) is checked as that IPv4 address too. `rules` None: only what is refused whatever
    the rules say (the API server, the metadata addresses)."""
    for text in addresses:
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            return f"host {host} resolves to {text[:64]!r}, which is not an address"
        where = f"host {host} resolves to {address}" if host != str(address) else str(address)
        checked: list[tuple[Address, str]] = [(address, "")]
        carried = embedded_ipv4(address)
        if carried is not None:  # the IPv4 address first: the reason then says what it is
            checked.insert(0, (carried[0], f"{carried[1]} of {carried[0]}, "))
        for candidate, form in checked:
            if str(candidate) in api_addresses or (str(candidate), port) in api_endpoints:
                return f"{where}, {form}the Kubernetes API server; never allowed"
            if any(candidate in net for net in REFUSED_NETWORKS):
                return (
                    f"{where}, {form}a link-local address (cloud metadata services answer "
                    "there); never allowed"
                )
            why = None if rules is None else _range_refusal(candidate, rules)
            if why is not None:
                return f"{where}, {form}{why}; {_opener(why)}"
    return None

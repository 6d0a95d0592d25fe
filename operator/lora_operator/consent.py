"""What a LoRAAdapter may use to fetch its source: which Secret, which host, which address, and
whether the operator's own cloud identity signs for it (pure: no I/O, no clock, no kopf).

- A Secret lends its values to LoRAAdapters only when it says so: the label or annotation
  `lora.dev/source-credentials: "true"`. Any other Secret of the namespace (a ServiceAccount's
  token, a database password) is refused before a value is read into a request.
- `Rules.hosts`: the hosts sources may name (an exact name, or `*.example.com` for its
  subdomains); empty allows every host.
- `Rules.ambient`: the namespaces whose s3:// sources without keys may be signed with the
  operator's own cloud identity (`*`: every namespace); elsewhere such a request goes unsigned.
- Addresses: a source host that resolves to a link-local address (the cloud metadata service
  among them) or to the Kubernetes API server is refused, so a LoRAAdapter cannot make the
  operator fetch from inside the cluster's control plane.

The controller resolves the host and reads the Secret (I/O); these functions decide.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from lora_operator import errors, sources

CONSENT_KEY = "lora.dev/source-credentials"
DEFAULT_HF_HOST = "huggingface.co"
DEFAULT_S3_HOST = "s3.amazonaws.com"

# Link-local (IPv4 and IPv6; the cloud metadata services answer there) and AWS's IPv6 metadata
# address, refused whatever the allowlist says.
REFUSED_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128")
)


class CredentialsRefused(errors.PermanentStagingError):
    reason = "SecretNotConsented"


class HostRefused(errors.PermanentStagingError):
    reason = "HostRefused"


@dataclass(frozen=True)
class Rules:
    hosts: tuple[str, ...] = ()  # empty: every host
    ambient: tuple[str, ...] = ("*",)  # namespaces whose s3:// may use the operator's identity

    def ambient_for(self, namespace: str) -> bool:
        return "*" in self.ambient or namespace in self.ambient


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


def source_endpoint(
    source: sources.Source, credentials: sources.Credentials, hf_endpoint: str | None
) -> tuple[str, int] | None:
    """The host and port the operator connects to for `source` (None: a volume path) (pure)."""
    if isinstance(source, sources.HttpsSource):
        url = source.url
    elif isinstance(source, sources.HfSource):
        url = hf_endpoint or f"https://{DEFAULT_HF_HOST}"
    elif isinstance(source, sources.S3Source):
        url = credentials.aws_endpoint_url or f"https://{DEFAULT_S3_HOST}"
    else:
        return None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = (parts.hostname or "").lower()
    return (host, port or (80 if parts.scheme == "http" else 443)) if host else None


def host_allowed(host: str, allowed: Collection[str]) -> bool:
    """Whether `host` matches the allowlist: an exact name, or `*.domain` for its subdomains;
    an empty list allows every host (pure)."""
    if not allowed:
        return True
    host = host.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower().rstrip(".")
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


def check_host(host: str, rules: Rules, what: str) -> None:
    if not host_allowed(host, rules.hosts):
        raise HostRefused(
            f"{what}: host {host} is not one the operator may fetch from "
            f"({', '.join(rules.hosts)}); ask the platform team to allow it "
            "(the chart's operator.sourceHosts)"
        )


def address_refusal(
    host: str,
    port: int,
    addresses: Iterable[str],
    api_addresses: Collection[str] = (),
    api_endpoints: Collection[tuple[str, int]] = (),
) -> str | None:
    """Why connecting to `port` at the resolved `addresses` of `host` is refused, or None (pure).

    `api_addresses`: addresses that are the Kubernetes API server on every port (its Service's
    virtual IP); `api_endpoints`: (address, port) pairs where it listens on a shared host (the
    address the operator logs in to)."""
    for text in addresses:
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        if any(address in net for net in REFUSED_NETWORKS):
            return f"host {host} resolves to {address}, a link-local address (metadata services)"
        if str(address) in api_addresses or (str(address), port) in api_endpoints:
            return f"host {host} resolves to {address}, the Kubernetes API server"
    return None

"""The playground: one self-contained web page for trying adapters, served at `/` by the router
and by a lone inference server.

The page (`index.html`: HTML, CSS and a little JavaScript, no build step) lists the adapters from
`GET /v1/models`, lets a user tick one or several (stacked, each with a scale slider), and draws
the base model and the adapters for the same prompt and seed side by side, with each image's time.
It calls the same public API a client does, through relative URLs, so it works behind any prefix
(the API server's service proxy, an ingress path); it needs no admin token, and a client token
only where the servers require one.

Both images install this package; it imports nothing of the project.
"""

from __future__ import annotations

from importlib import resources

# The page runs its own inline script and style and shows images from data: URLs; nothing else.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def page() -> bytes:
    """The page's HTML."""
    return resources.files(__package__).joinpath("index.html").read_bytes()


def headers() -> dict[str, str]:
    """The headers the page is served with."""
    return {
        "Content-Type": "text/html; charset=utf-8",
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
    }

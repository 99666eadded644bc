"""What stands before every endpoint of the dashboard: the ``Host`` check, and the headers
that keep a browser from framing the page, sniffing a run's file into a script, or sending
the page's address (and its token) to another site.
"""

from __future__ import annotations

from shoal.dashboard.hosts import HostRule

# The page loads only its own files; its runs' files are shown as text in a sandbox.
POLICY = (b"default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
          b"object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"no-referrer"), (b"content-security-policy", POLICY)]


class Guard:
    """ASGI middleware: a request whose ``Host`` is not one of the server's names gets a
    403 and one line saying why; every response gets ``HEADERS``."""

    def __init__(self, app, rule: HostRule):
        self.app, self.rule = app, rule

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [value.decode("latin-1") for name, value in scope["headers"] if name == b"host"]
        if len(hosts) > 1 or not self.rule.allows(hosts[0] if hosts else None):
            await _refuse(send, hosts)
            return

        async def with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


async def _refuse(send, hosts: list[str]) -> None:
    shown = ascii(hosts[0][:80]) if len(hosts) == 1 else f"given {len(hosts)} times"
    body = (f"shoal dashboard: Host {shown} is not a name of this server (a page of "
            "another site may be reaching it); if it is one, allow it with --allow-host NAME "
            "(--dashboard-allow-host with --dashboard)\n").encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *HEADERS]})
    await send({"type": "http.response.body", "body": body})

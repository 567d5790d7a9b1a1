"""Fetching image URLs on a client's behalf, safely (the server's ``--allow-fetch``).

A server that fetches whatever URL a client names is a proxy into its own network: loopback, the
cloud metadata address, private services (server-side request forgery, OWASP SSRF Prevention Cheat
Sheet). :class:`FetchPolicy` admits a URL only when every address its host resolves to is allowed:

- a host listed by name (``images.example.com``) admits its addresses only when they are public
  (:func:`is_public`: never loopback, link-local, private, shared, reserved, multicast or
  unspecified), or inside a listed network; a listed network (``10.0.0.0/8``, ``192.168.1.7``)
  admits the numeric hosts inside it, whatever they are: naming a private network is how an
  operator allows one; a name not listed is refused before any DNS lookup (a client cannot make
  the server resolve names for it);
- numeric hosts are read the way the C library reads them (``socket.inet_aton``: ``2130706433``,
  ``0x7f.1``, ``0177.0.0.1`` and ``127.1`` are all 127.0.0.1), and IPv4-mapped IPv6 addresses
  (``::ffff:127.0.0.1``) are checked as the IPv4 address they carry;
- the name is resolved once, and the connection goes to the address that was checked (the URL is
  rewritten to it; ``Host`` and, for https, the TLS server name stay the original host), so a DNS
  answer that changes between check and connect (rebinding) cannot redirect it;
- redirects are followed by hand, at most :attr:`FetchPolicy.max_redirects`, each checked the same way;
- the body is streamed and cut at ``max_bytes``; it must come uncompressed (``Accept-Encoding:
  identity``; a compressed answer is refused, as it would be inflated before any limit saw it).

Every refusal and failure raises :class:`FetchRefused` with the detail (for the server's log); the
client is told only "cannot fetch URL N".
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit, urlunsplit

_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|[0-9A-Fa-f:.]{2,45}")  # a name or number, or an IPv6 literal
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class FetchRefused(Exception):
    """A URL that was not fetched: refused by the policy, or failed; the message is the detail."""


def parse_ip(host: str) -> IPAddress | None:
    """The address a numeric host names, in any spelling the C library accepts, IPv4-mapped IPv6
    unwrapped; ``None`` for a name.

    >>> str(parse_ip("2130706433")), str(parse_ip("0x7f.1")), str(parse_ip("[::ffff:127.0.0.1]"))
    ('127.0.0.1', '127.0.0.1', '127.0.0.1')
    """
    h = host.strip("[]").rstrip(".")
    try:
        ip = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        if not h or not all(c in "0123456789abcdefxABCDEFX." for c in h) or not h[0].isdigit():
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_public(ip: IPAddress) -> bool:
    """An address on the public internet: not loopback, link-local (169.254.0.0/16, fe80::/10: the
    cloud metadata services live there), private, shared (100.64.0.0/10), reserved, multicast or
    unspecified."""
    return ip.is_global and not (
        ip.is_multicast or ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_reserved or ip.is_private
    )


@dataclass
class FetchPolicy:
    """Which URLs a server may fetch for its clients, and how much of each.

    Args:
        allow: hosts (``images.example.com``: its public addresses) and networks or addresses
            (``10.1.0.0/16``, ``192.168.1.7``, ``::1``: everything inside, private included).
        max_bytes: most bytes read from one URL; more is an error.
        timeout_s: the whole fetch of one URL, redirects included.
        max_redirects: redirects followed, each checked as the first URL was.

    Raises:
        ValueError: an entry that is neither a host name nor a network.
    """

    allow: tuple[str, ...]
    max_bytes: int = 32 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    hosts: set[str] = field(default_factory=set, init=False)
    networks: list[IPNetwork] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for entry in self.allow:
            e = entry.strip().lower()
            try:
                self.networks.append(ipaddress.ip_network(e.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            ip = parse_ip(e)
            if ip is not None:
                self.networks.append(ipaddress.ip_network(ip))
            elif (
                e
                and all(part and all(c.isalnum() or c == "-" for c in part) for part in e.rstrip(".").split("."))
                and not e.rstrip(".").rsplit(".", 1)[-1].isdigit()  # (999.1.1.1: no name, and no address)
            ):
                self.hosts.add(e.rstrip("."))
            else:
                raise ValueError(f"--allow-fetch {entry!r}: neither a host name nor an address or network")

    def admits(self, host: str, ip: IPAddress) -> bool:
        """Whether a connection to ``ip`` for the URL host ``host`` is allowed."""
        if any(ip in net for net in self.networks if net.version == ip.version):
            return True
        return host.lower().rstrip(".") in self.hosts and is_public(ip)

    async def resolve(self, url: str) -> tuple[str, str, IPAddress, int]:
        """``(scheme, host, the checked address, port)`` for ``url``.

        Raises:
            FetchRefused: not http(s), no host, a name not listed (not resolved) or that does not
                resolve, or an address the policy does not admit (any of the name's addresses, so that none is left to chance).
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchRefused(f"not an http(s) URL with a host: {url[:200]}")
        if parts.username or parts.password:
            raise FetchRefused("credentials in the URL")
        host = parts.hostname
        if not _HOST.fullmatch(host):  # (no zone ids, escapes or spaces: they would ride along in Host)
            raise FetchRefused(
                f"a host of other characters than letters, digits, '.', '-' (or an IPv6 literal): {host[:100]!r}"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise FetchRefused(f"bad port in {url[:200]}") from None
        ip = parse_ip(host)
        if ip is not None:
            addrs = [ip]
        elif host.lower().rstrip(".") not in self.hosts:  # no DNS lookup on a client's behalf for it
            raise FetchRefused(f"{host}: a name not listed, not admitted by --allow-fetch (not resolved)")
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError) as e:
                raise FetchRefused(f"{host} does not resolve ({e})") from None
            addrs = [parse_ip(info[4][0]) for info in infos]
        bad = [a for a in addrs if a is None or not self.admits(host, a)]
        if not addrs or bad:
            raise FetchRefused(f"{host} -> {', '.join(map(str, addrs))}: not admitted by --allow-fetch")
        return parts.scheme, host, addrs[0], port

    async def fetch(self, client, url: str, budget: list[int] | None = None) -> bytes:
        """The body of ``url`` (status 200), fetched under this policy with ``client`` (an
        ``httpx.AsyncClient`` that follows no redirects itself). ``budget``: a one-element list of
        the bytes the whole request may still read, shared by its URLs and decreased as they arrive.

        Raises:
            FetchRefused: with the detail: refused, too many redirects, another status, too large,
                timed out, or a transport error.
        """
        try:
            return await asyncio.wait_for(self._fetch(client, url, budget), self.timeout_s)
        except TimeoutError:
            raise FetchRefused(f"timeout after {self.timeout_s:g} s") from None

    async def _fetch(self, client, url: str, budget: list[int] | None) -> bytes:
        import httpx

        for _ in range(self.max_redirects + 1):
            scheme, host, ip, port = await self.resolve(url)
            parts = urlsplit(url)
            netloc = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
            pinned = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
            # identity only: a compressed body would be inflated by the client before any limit could
            # see it (a gzip bomb of 64 KiB can become 64 MiB in one chunk); images gain nothing from it
            headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept-Encoding": "identity"}
            ext = {"sni_hostname": host} if scheme == "https" else {}
            try:
                async with client.stream("GET", pinned, headers=headers, extensions=ext) as r:
                    if r.status_code in (301, 302, 303, 307, 308) and "location" in r.headers:
                        url = urljoin(url, r.headers["location"])
                        continue
                    if r.status_code != 200:
                        raise FetchRefused(f"HTTP {r.status_code} from {host}")
                    if r.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
                        raise FetchRefused(f"a {r.headers['content-encoding']!r}-encoded body (identity was asked for)")
                    declared = r.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > self.max_bytes:
                        raise FetchRefused(f"{declared} bytes declared, over the limit of {self.max_bytes}")
                    buf = bytearray()
                    try:
                        async for chunk in r.aiter_raw():
                            buf += chunk
                            if budget is not None:
                                budget[0] -= len(chunk)
                            if len(buf) > self.max_bytes:
                                raise FetchRefused(f"body over the limit of {self.max_bytes} bytes")
                            if budget is not None and budget[0] < 0:
                                raise FetchRefused("the request's URLs together are over its byte limit")
                    except BaseException:
                        if budget is not None:  # (a URL that failed holds nothing: its bytes count no more)
                            budget[0] += len(buf)
                        raise
                    return bytes(buf)
            except (httpx.HTTPError, httpx.InvalidURL, UnicodeError, ValueError) as e:  # (too long, control chars)
                raise FetchRefused(f"{type(e).__name__} fetching from {host}: {str(e)[:200]}") from None
        raise FetchRefused(f"more than {self.max_redirects} redirects")

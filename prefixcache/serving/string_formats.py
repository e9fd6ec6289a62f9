"""Checkers of JSON schema's string ``format``s that strict tool modes guarantee, on the standard library.

Each takes a string and says whether it is one of the format: ``date-time``, ``date`` and ``time`` as RFC
3339 writes them (``time`` with its offset; ``T`` and ``Z`` in either case; second 60 only where the time,
moved to UTC, is 23:59), ``duration`` as ISO 8601 (as RFC 3339 appendix A writes it: whole numbers, units
in order), ``email`` (a dot-atom or quoted local part of at most 64 characters, then a hostname or a
bracketed address), ``hostname`` (RFC 1123: labels of letters, digits and inner hyphens, at most 63
characters each and 253 in all; IDNA 2008's rules on what an ``xn--`` label decodes to are not checked),
``ipv4`` and ``ipv6`` (``ipaddress``; no leading zeros, no IPv6 zone), ``uuid`` (RFC 4122's 8-4-4-4-12 hex
digits) and ``uri`` (RFC 3986: a scheme, then only the characters a URI may hold). Every pattern here is
anchored and linear: the model's text cannot make one backtrack.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})")
_TIME = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.[0-9]+)?(?:[zZ]|([+-])([0-9]{2}):([0-9]{2}))")
_DURATION = re.compile(r"P(?:(?:[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:T(?:[0-9]+H(?:[0-9]+M"
                       r"(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S))?|T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M"
                       r"(?:[0-9]+S)?|[0-9]+S)|[0-9]+W)")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ATOM = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*")
_QUOTED = re.compile(r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\[\x20-\x7e])*"')
_UUID = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(?://([^/?#]*))?[^?#]*(?:\?[^#]*)?(?:#.*)?", re.DOTALL)
_URI_CHARS = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?#]|%[0-9A-Fa-f]{2})*")
_AUTHORITY = re.compile(r"(?:(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*@)?(\[[^\]]*\]|[^:]*)(?::[0-9]*)?",
                        re.DOTALL)
_IPVFUTURE = re.compile(r"v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+")


def is_date(text: str) -> bool:
    """RFC 3339 ``full-date``: ``YYYY-MM-DD``, a day the month has."""
    match = _DATE.fullmatch(text)
    return match is not None and _day_exists(*map(int, match.groups()))


def is_time(text: str) -> bool:
    """RFC 3339 ``full-time``: ``HH:MM:SS[.frac]`` and ``Z`` or an offset; second 60 only at 23:59 UTC."""
    match = _TIME.fullmatch(text)
    if match is None:
        return False
    hour, minute, second = (int(part) for part in match.group(1, 2, 3))
    sign, offset_hours, offset_minutes = match.group(4, 5, 6)
    offset = 0 if sign is None else (1 if sign == "+" else -1) * (int(offset_hours) * 60 + int(offset_minutes))
    if hour > 23 or minute > 59 or second > 60 or (sign is not None and (int(offset_hours) > 23
                                                                          or int(offset_minutes) > 59)):
        return False
    return second < 60 or (hour * 60 + minute - offset) % (24 * 60) == 23 * 60 + 59


def is_date_time(text: str) -> bool:
    """RFC 3339 ``date-time``: a ``full-date``, ``T`` (or ``t``), a ``full-time``."""
    date, separator, time = text[:10], text[10:11], text[11:]
    return separator in ("T", "t") and is_date(date) and is_time(time)


def is_duration(text: str) -> bool:
    """An ISO 8601 duration as RFC 3339 appendix A writes it: ``P1Y2M3DT4H5M6S``, leading and trailing units
    left out (``P2M``, ``PT36H``, ``P1DT12H``; not ``P1Y2D``), or weeks alone (``P2W``)."""
    return _DURATION.fullmatch(text) is not None


def is_hostname(text: str) -> bool:
    """An RFC 1123 host name: dot-separated labels of 1 to 63 letters, digits and inner hyphens; 253 in all. A
    label with ``--`` third and fourth is an ``xn--`` one whose Punycode decodes (IDNA 2008's rules on the
    characters it decodes to are not checked)."""
    return 0 < len(text) <= 253 and all(_LABEL.fullmatch(label) and _not_reserved(label) for label in text.split("."))


def is_email(text: str) -> bool:
    """``local@domain``: a dot-atom or quoted local part (64 characters at most), then a host name or an address
    in brackets (``[192.0.2.1]``, ``[IPv6:2001:db8::1]``)."""
    local, at, domain = text.rpartition("@")
    if not at or len(local) > 64 or not (_ATOM.fullmatch(local) or _QUOTED.fullmatch(local)):
        return False
    if domain.startswith("[") and domain.endswith("]"):
        literal = domain[1:-1]
        return is_ipv6(literal[5:]) if literal[:5].lower() == "ipv6:" else is_ipv4(literal)
    return is_hostname(domain)


def is_ipv4(text: str) -> bool:
    """A dotted-quad IPv4 address (no leading zeros)."""
    return text.isascii() and _parses(ipaddress.IPv4Address, text)


def is_ipv6(text: str) -> bool:
    """An RFC 4291 IPv6 address (with an embedded IPv4 tail allowed; a ``%zone`` is no part of one)."""
    return text.isascii() and "%" not in text and _parses(ipaddress.IPv6Address, text)


def is_uuid(text: str) -> bool:
    """RFC 4122's textual UUID: 32 hex digits grouped 8-4-4-4-12 by hyphens."""
    return _UUID.fullmatch(text) is not None


def is_uri(text: str) -> bool:
    """An RFC 3986 URI (not a relative reference): a scheme and ``:``, then URI characters (``%`` escapes
    whole), an authority's host a name or a bracketed IPv6 or IPvFuture literal, its port digits."""
    match = _URI.fullmatch(text)
    if match is None:
        return False
    authority = match.group(1)
    rest = text if authority is None else text.replace(f"//{authority}", "//", 1)
    if not _URI_CHARS.fullmatch(rest) or rest.count("#") > 1:
        return False
    if authority is None:
        return True
    parts = _AUTHORITY.fullmatch(authority)
    if parts is None:
        return False
    host = parts.group(1)
    if host.startswith("["):
        return host.endswith("]") and (is_ipv6(host[1:-1]) or _IPVFUTURE.fullmatch(host[1:-1]) is not None)
    return _URI_CHARS.fullmatch(host) is not None and not set(host) & set(":@/?#")


#: Each format named as JSON schema names it, and its checker.
CHECKERS: dict[str, Callable[[str], bool]] = {
    "date-time": is_date_time, "date": is_date, "time": is_time, "duration": is_duration, "email": is_email,
    "hostname": is_hostname, "ipv4": is_ipv4, "ipv6": is_ipv6, "uuid": is_uuid, "uri": is_uri,
}


def _parses(address: Callable[[str], object], text: str) -> bool:
    try:
        address(text)
    except ValueError:
        return False
    return True


def _not_reserved(label: str) -> bool:
    """RFC 5891: ``??--`` begins only an A-label (``xn--`` and Punycode), whose own third and fourth are no ``--``."""
    if label[2:4] != "--":
        return True
    if label[:2].lower() != "xn":
        return False
    try:
        decoded = label[4:].encode("ascii").decode("punycode")
    except UnicodeError:
        return False
    return decoded[2:4] != "--"


def _day_exists(year: int, month: int, day: int) -> bool:
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]

"""The string formats strict tools assert: each checker against values of its format and values just outside it."""
from __future__ import annotations

import pytest

from prefixcache.serving.string_formats import CHECKERS

VALID = {
    "date-time": ["1963-06-19T08:30:06.283185Z", "1963-06-19T08:30:06Z", "1937-01-01T12:00:27.87+00:20",
                  "1990-12-31T15:59:50.123-08:00", "1963-06-19t08:30:06.283185z",  # lowercase t and z
                  "1998-12-31T23:59:60Z", "1998-12-31T15:59:60.123-08:00",  # leap seconds, UTC and shifted
                  "1998-12-31T23:59:60+00:00", "1999-01-01T00:29:60+00:30", "2000-02-29T00:00:00-00:00",
                  "0000-01-01T00:00:00Z"],
    "date": ["1963-06-19", "2020-01-31", "2021-02-28", "2020-02-29", "2000-02-29", "2020-04-30", "0000-02-29"],
    "time": ["08:30:06Z", "08:30:06.283185Z", "08:30:06+00:20", "08:30:06-08:00", "08:30:06z", "23:59:60Z",
             "15:59:60-08:00", "23:38:60+23:39", "00:29:60+00:30", "01:29:60+01:30", "23:59:59.1234567890+23:59"],
    "duration": ["P4Y", "PT0S", "P0D", "P1M", "PT1M", "PT36H", "P1DT12H", "P2W", "P1Y2M3DT4H5M6S", "P2M3D",
                 "PT4H5M", "PT5M6S", "P1Y2M"],
    "email": ["joe.bloggs@example.com", "te~st@example.com", "~test@example.com", "test~@example.com",
              '"joe bloggs"@example.com', '"joe..bloggs"@example.com', '"joe@bloggs"@example.com',
              "joe.bloggs@[127.0.0.1]", "joe.bloggs@[IPv6:::1]", "te.s.t@example.com", "a@b", "x+tag@host-1.io"],
    "hostname": ["www.example.com", "xn--4gbwdl.xn--wgbh1c", "a" * 63 + ".com", "hostname", "host-name",
                 "h0stn4me", "1host", "hostnam3", "XN--nw2a", "localhost", ".".join(["a" * 63] * 3) + "." + "a" * 61],
    "ipv4": ["192.168.0.1", "0.0.0.0", "255.255.255.255", "87.10.0.1"],
    "ipv6": ["::1", "::", "::abef", "2345::", "1::d6:192.168.0.1", "::ffff:192.168.0.1", "1:2:3:4:5:6:7:8",
             "1:d6::42", "1::", "FEDC:BA98:7654:3210:FEDC:BA98:7654:3210", "::42:ff:1", "fe80::a"],
    "uuid": ["2EB8AA08-AA98-11EA-B4AA-73B441D16380", "2eb8aa08-aa98-11ea-b4aa-73b441d16380",
             "00000000-0000-0000-0000-000000000000", "98d80576-482e-427f-8434-7f86890ab222",
             "99c17cbb-656f-564a-940f-1a4568f03487"],
    "uri": ["http://foo.bar/?baz=qux#quux", "http://foo.com/blah_(wikipedia)_blah#cite-1",
            "http://foo.bar/?q=Test%20URL-encoded%20stuff", "http://xn--nw2a.xn--j6w193g/",
            "http://-.~_!$&'()*+,;=:%40:80%2f::::::@example.com", "http://223.255.255.254", "ftp://ftp.is.co.za/rfc/",
            "ldap://[2001:db8::7]/c=GB?objectClass?one", "mailto:John.Doe@example.com", "news:comp.infosystems.www",
            "tel:+1-816-555-1212", "urn:oasis:names:specification:docbook:dtd:xml:4.1.2", "file:///etc/hosts",
            "http://[v1.fe80::a+en1]/", "http://example.com:8080/a", "http://example.com:/a", "x:"],
}

INVALID = {
    "date-time": ["1998-12-31T23:59:61Z", "1998-12-31T23:58:60Z", "1998-12-31T22:59:60Z",  # no such leap seconds
                  "1998-12-31T23:59:60+01:00", "1990-02-31T15:59:59.123-08:00", "1990-12-31T15:59:59-24:00",
                  "1963-06-19T08:30:06.28123+01:00Z", "06/19/1963 08:30:06 PST", "2013-350T01:01:01",
                  "1963-6-19T08:30:06.283185Z", "1963-06-1T08:30:06.283185Z", "1963-06-1৪T00:00:00Z",
                  "1963-06-11T0৪:00:00Z", "1963-06-19 08:30:06Z", "1963-06-19T08:30:06", "yesterday",
                  "2026-11-27T10:00:00Z\n", "", "2026-11-27"],
    "date": ["2020-01-32", "2021-02-29", "1900-02-29", "2020-02-30", "2020-04-31", "2020-13-01", "2020-00-10",
             "2020-01-00", "06/19/1963", "2013-350", "1998-1-20", "1998-01-1", "1998-13-01", "1963-06-1৪",
             "20230328", "2023-W01", "2023-W13-2", "2022W527", "1963-06-19\n", "1963-06-19T00:00:00Z"],
    "time": ["008:030:006Z", "8:3:6Z", "8:0030:6Z", "22:59:60Z", "23:58:60Z", "23:59:60+01:00", "22:59:60+00:00",
             "23:59:60-08:00", "24:00:00Z", "00:60:00Z", "00:00:61Z", "01:02:03+24:00", "01:02:03+00:60",
             "01:02:03Z+00:30", "08:30:06 PST", "01:01:01,1111", "12:00:00", "12:00:00.Z", "1২:00:00Z",
             "12:00:00+0800", "T08:30:06Z"],
    "duration": ["PT1D", "P", "P1YT", "PT", "P2D1Y", "P1D2H", "P2S", "P1", "P1Y2W", "P২Y", "P1Y2D", "PT1H2S",
                 "P1.5Y", "PT0.5S", "p1y", "P-1D", "1Y", "P1W2D", " P1D"],
    "email": ["2962", ".test@example.com", "test.@example.com", "te..st@example.com", "joe.bloggs@invalid=domain.com",
              "joe.bloggs@[127.0.0.300]", "joe bloggs@example.com", "@example.com", "joe@", "joe@.com",
              "a" * 65 + "@example.com", "joe@[IPv6:fe80::1%eth0]", '"joe"bloggs"@example.com', "jöe@example.com",
              "joe@exa_mple.com"],
    "hostname": ["-a-host-name-that-starts-with--", "not_a_valid_host_name", "a-vvvvvvvvvvvvvvvveeeeeeeeeeeeeeeee" * 2,
                 "-hostname", "hostname-", "_hostname", "hostname_", "host_name", "", ".", ".example", "example.",
                 "a" * 64 + ".com", ".".join(["a" * 63] * 4), "ex ample.com", "exämple.com", "XN--aa---o47jg78q",
                 "xn--X", "ab--cd"],
    "ipv4": ["127.0.0.0.1", "256.256.256.256", "127.0", "0x7f000001", "2130706433", "087.10.0.1", "1.2.3.4\n",
             "1২7.0.0.1", "192.168.1.0/24", " 1.2.3.4", "1.2.3."],
    "ipv6": ["12345::", "::abcef", "1:1:1:1:1:1:1:1:1:1:1:1:1:1:1:1", "::laptop", ":2:3:4:5:6:7:8",
             "1:2:3:4:5:6:7:", ":2:3:4::8", "1::d6::42", "1::2:192.168.256.1", "1::2:192.168.ff.1", "fe80::a%eth1",
             "fe80::1%1", " ::1", "::1 ", "1:2:3:4:5:6:7:৪", "100:100:100:100:100:100:255.255.255.255.255", ""],
    "uuid": ["2eb8aa08-aa98-11ea-b4aa-73b441d1638", "2eb8aa08-aa98-11ea-73b441d16380", "2eb8aa08-aa98-11ea-b4ga-73b441d16380",
             "2eb8aa08aa9811eab4aa73b441d16380", "2eb8aa08aa98-11ea-b4aa73b441d16380", "2eb8-aa08-aa98-11ea-b4aa73b44-1d16380",
             "{2eb8aa08-aa98-11ea-b4aa-73b441d16380}", "urn:uuid:2eb8aa08-aa98-11ea-b4aa-73b441d16380",
             "2eb8aa08-aa98-11ea-b4aa-73b441d16380\n", ""],
    "uri": ["//foo.bar/?baz=qux#quux", "abc", "\\\\WINDOWS\\fileshare", "http:// shouldfail.com", ":// should fail",
            "bar,baz:foo", "https://[@example.org/test.txt", "https://example.org/foobar®.txt",
            "https://example.org/foobar\\.txt", 'https://example.org/foo"bar', "http://a.b/%zz", "http://a.b/%4",
            "http://a.b/#x#y", "http://[::1/", "http://[fe80::1%25en0]/", "http://a.b:8o/", "1http://a.b/",
            "http://a b/", "http://a.b/\n"],
}


@pytest.mark.parametrize(("name", "value"), [(name, v) for name, values in VALID.items() for v in values])
def test_a_value_of_the_format_passes(name, value):
    assert CHECKERS[name](value)


@pytest.mark.parametrize(("name", "value"), [(name, v) for name, values in INVALID.items() for v in values])
def test_a_value_outside_the_format_fails(name, value):
    assert not CHECKERS[name](value)


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_a_long_value_is_checked_in_linear_time(name):
    """The checkers meet the model's text: a long near-miss fails without backtracking (a second would be far too
    long for what a linear scan does in a millisecond; no timing asserted, the run simply ends)."""
    for value in ("1" * 100_000 + "x", "P" + "1" * 100_000 + "Q", "a" * 100_000 + "@", "a." * 50_000 + "-",
                  "x:" + "%4" * 50_000, "http://" + "a" * 100_000 + ":x"):
        assert not CHECKERS[name](value)

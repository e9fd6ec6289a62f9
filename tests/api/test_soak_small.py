"""The soak benchmark at CI scale: ``prefixcache serve`` (a tiny model) with a well-behaved and a
hostile tenant; every hostile case and mid-stream disconnects, no 5xx, no hang, nothing held at idle."""
from __future__ import annotations

from benchmarks import soak


def test_a_small_soak_has_no_5xx_no_hang_and_leaves_nothing_held():
    report = soak.run(soak.build_parser().parse_args(["--requests", "60", "--deadline", "60"]))
    assert report["responses_5xx"] == 0 and report["hung"] == 0, report["statuses"]
    assert report["requests"] >= 60
    hostile = report["hostile"]["statuses"]
    for status in ("400", "401", "413", "disconnected"):  # limits, strangers, bodies, streams dropped
        assert hostile.get(status, 0) > 0, hostile
    sent = {case.rsplit(" ", 1)[0] for case in report["hostile"]["cases"]}
    assert sent == set(soak.case_names()), sent  # every hostile case went out
    assert sum(report["hostile"]["cases"].values()) == report["hostile"]["requests"]
    assert report["good_alone"]["statuses"] == {"200": 15} and report["good_mixed"]["statuses"] == {"200": 15}
    assert report["good_mixed"]["token_hit_rate"] > 0.5  # the system prompt stayed cached under attack
    idle = report["idle"]
    assert idle["refcounts"] == 0 and idle["stored_bytes"] == idle["live_tensor_bytes"] > 0
    assert idle["in_flight_kv_bytes"] == {"private": 0, "serial": 0, "prewarm": 0}
    assert report["server_peak_rss_bytes"] > 0

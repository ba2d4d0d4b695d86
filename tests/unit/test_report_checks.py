"""render_checks: a table per host, failures first with their fix, and the network figures."""

import io

from raycluster_cli.checks import CheckResult, Status
from raycluster_cli.render.base import Output
from raycluster_cli.render.checks import render_checks


def rendered(results: list[CheckResult]) -> str:
    out = io.StringIO()
    render_checks(Output(False, stdout=out, stderr=io.StringIO()), results)
    return out.getvalue()


def test_failures_first_with_the_fix_per_host() -> None:
    text = rendered(
        [
            CheckResult("docker", "192.0.2.12", Status.OK, "Docker engine 24 answers"),
            CheckResult("clock", "192.0.2.12", Status.WARN, "clock is 9.0s ahead", "run NTP"),
            CheckResult("etc-hosts", "192.0.2.12", Status.FAIL, "/etc/hosts maps n2 to 127.0.1.1", "fix line"),
            CheckResult("docker", "192.0.2.11", Status.OK, "Docker engine 24 answers"),
        ]
    )
    assert text.index("host 192.0.2.12") < text.index("host 192.0.2.11")
    block = text[text.index("host 192.0.2.12") : text.index("host 192.0.2.11")]
    assert block.index("FAIL") < block.index("WARN") < block.index("OK")
    assert "fix line" in block and "run NTP" in block
    assert "FAILED: 1 failure(s), 1 warning(s) on 2 host(s)" in text
    assert "network:" not in text


def test_network_figures_table() -> None:
    data = {"tool": "iperf3", "rtt_ms": 0.08, "to_head_bps": 9.4e9, "from_head_bps": 8.7e8}
    text = rendered(
        [
            CheckResult("mtu", "192.0.2.12", Status.WARN, "MTU 1400", "same MTU", {"interface": "eth0", "mtu": 1400}),
            CheckResult("network", "192.0.2.12", Status.OK, "rtt 0.080 ms", data=data),
            CheckResult("path-mtu", "192.0.2.12", Status.WARN, "blocked", "same MTU"),
        ]
    )
    table = text[text.index("network: head") :]
    assert "9.40 Gbit/s" in table and "870 Mbit/s" in table and "1400" in table and "warn" in table
    assert "0.080" in table and "iperf3" in table

import io

from raycluster_cli.progress import TransferProgress
from raycluster_cli.report import Output


def test_live_progress_shows_a_bar_per_host_and_the_lines_between() -> None:
    err = io.StringIO()
    with Output(False, stderr=err).live_progress() as progress:
        progress("preflight [checks]")
        for host in ("192.0.2.12", "192.0.2.13"):
            progress(TransferProgress(host, 0, 2_000_000))
        for host in ("192.0.2.12", "192.0.2.13"):
            progress(TransferProgress(host, 2_000_000, 2_000_000, done=True))
        progress("head next")
    text = err.getvalue()
    assert "· preflight [checks]" in text
    assert "image → 192.0.2.12" in text and "image → 192.0.2.13" in text
    assert "2.0/2.0 MB" in text
    assert text.index("image → 192.0.2.13") < text.index("head next")

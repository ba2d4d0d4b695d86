"""``node.reach``: the cut pairs, and the set of nodes a pipeline may be planned over when two of them cannot reach
each other (the sockets: tests/local/test_reach_loopback.py)."""

from __future__ import annotations

from raycluster_cli.node.reach import connected, cut_pairs, describe


def test_either_side_failing_cuts_the_pair_and_the_connected_set_keeps_the_preferred_nodes() -> None:
    cuts = cut_pairs({"h1": [], "h2": ["h3"], "h3": []})
    assert cuts == {frozenset(("h2", "h3"))}
    assert connected(["h1", "h2", "h3"], cuts) == ["h1", "h2"]
    assert connected(["h3", "h1", "h2"], cuts) == ["h3", "h1"]  # the first (the fastest) is kept
    assert connected(["h1", "h2", "h3"], set()) == ["h1", "h2", "h3"]
    assert describe(cuts, {"h2": "10.0.0.12", "h3": "10.0.0.13"}) == "10.0.0.12 <-> 10.0.0.13"

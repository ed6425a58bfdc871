"""Staleness along the lineage, in registered versions and in updates, and the covered bus ranges."""

from learner.lineage import anchor, merge_covered, staleness


def state(versions, published, parents):
    return {"versions": versions, "published": published, "parents": parents, "current": versions[-1]}


def test_staleness_counts_registered_versions_along_the_parents():
    # base <- v1 <- v4 (in flight) with v2, v3, v5 held back on top: the anchor is v4.
    s = state(
        ["base", "v1", "v2", "v3", "v4", "v5"],
        ["base", "v1", "v4"],
        {"v1": "base", "v4": "v1"},
    )
    assert anchor(s) == "v4"
    # v5, held back past the anchor, is ahead of it: 0 (only lent rollouts sample a held-back version)
    assert staleness(s, "versions") == {"v5": 0, "v4": 0, "v1": 1, "base": 2}
    assert staleness(s, "updates") == {"v5": 0, "v4": 1, "v3": 2, "v2": 3, "v1": 4, "base": 5}


def test_an_abandoned_branch_counts_through_the_common_ancestor():
    # v4 was rejected; the lineage rebased onto the promoted v1 and registered v6 on it.
    s = state(
        ["base", "v1", "v2", "v3", "v4", "v5", "v1", "v6"],
        ["base", "v1", "v4", "v6"],
        {"v1": "base", "v4": "v1", "v6": "v1"},
    )
    assert staleness(s, "versions") == {"v6": 0, "v1": 1, "base": 2, "v4": 2}
    assert staleness(s, "updates")["v1"] == 1 and staleness(s, "updates")["v4"] == 3  # last positions
    # A version with no common ancestor (another lineage's) is unknown, not fresh.
    s["published"].append("foreign")
    assert "foreign" not in staleness(s, "versions")


def test_merge_covered_spans_every_range_per_partition():
    assert merge_covered([{"0": (5, 10), "1": (0, 3)}, {"0": [10, 15]}, {"2": (7, 8)}]) == {
        "0": (5, 15),
        "1": (0, 3),
        "2": (7, 8),
    }

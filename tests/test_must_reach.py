"""Every coverage edge a verify campaign requires (``Kind.must_reach``) is
reached within the first ~25 examples: the rate of a campaign on a GPU,
where ``kvspec verify --device gpu`` runs about ten times fewer ops than on
the CPU in the same budget (an edge reached by chance after 200 examples
is missed there). The biases that make it so: the kind's ``sweep`` (a
field whose every value is an edge, pinned batch by batch) and a rule per
rare edge (the ring's ``reject_block``)."""

from __future__ import annotations

import pytest

from kvspec.fuzz import kinds
from kvspec.fuzz.campaign import Campaign

EXAMPLES = 25
CASES = [(k.kind, mode, inplace, seed) for k in kinds.KINDS.values() if k.must_reach
         for mode, inplace in k.campaigns for seed in (4, 6)]


@pytest.mark.parametrize(("kind", "mode", "inplace", "seed"), CASES)
def test_must_reach_within_few_examples(kind: str, mode: str, inplace: bool, seed: int) -> None:
    """Up to EXAMPLES examples, stopping at the batch that reaches the last
    edge (the claim is "within EXAMPLES": the examples after it check
    nothing more here). A kind without a sweep runs batches of 5 (seeds
    ``seed``, ``seed + 1``, ...); a sweep's batches stay verify's 25 (5
    per pinned value: a smaller batch would pin one value per example)."""
    entry = kinds.get(kind, mode)
    run = Campaign(kind, mode, inplace, 20261129 + seed, batch=25 if entry.sweep else 5)

    def missing() -> list[str]:
        return [label for label in entry.must_reach if not run.report.stats.get(label)]

    while run.report.examples < EXAMPLES and not run.failed and missing():
        run.batch()
    assert run.report.failure is None, run.report.failure.error
    missed = missing()
    assert not missed, f"{kind}/{mode}/{inplace}: NOT REACHED in {run.report.examples} examples: {missed}"


#: catalog bugs whose edge is rare under random ops: their biasing rule
#: must make every seed catch them within a few dozen examples (before the
#: rules, on seeds 1-3: old_regrow_guard 182, 15, 270 examples;
#: inplace_after_trim 32, 81, 5)
FAST = ("old_regrow_guard", "inplace_after_trim")


@pytest.mark.parametrize("name", FAST)
def test_rare_edge_bugs_are_caught_within_40_examples(name: str, tmp_path) -> None:
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.campaign import catch_bug

    bug = by_name(name)
    examples = []
    for seed in (1, 2, 3):
        caught, _seconds, n, _path, alarm, _flaky = catch_bug(bug, seed, 60, tmp_path, shrink=False)
        assert caught and alarm is None, (seed, n, alarm)
        examples.append(n)
    assert max(examples) <= 40, examples


def test_a_campaign_goes_on_past_its_budget_until_its_edges_are_reached() -> None:
    """verify's campaigns (``reach``): a device that runs few examples in
    the budget (the H200 ran 20 in 8 s and missed undo=4) keeps searching
    up to ``reach_budget`` while an edge is missing, instead of failing
    with NOT REACHED; without ``reach`` the budget alone decides."""
    from kvspec.fuzz.campaign import campaign

    entry = kinds.get("rotating", "fp16")
    short = campaign("rotating", "fp16", True, 0.0, 20261129)
    assert short.batches == 1 and [label for label in entry.must_reach if not short.stats.get(label)]
    full = campaign("rotating", "fp16", True, 0.0, 20261129, reach=entry.must_reach, reach_budget=300.0)
    assert full.failure is None and full.batches > 1
    assert not [label for label in entry.must_reach if not full.stats.get(label)], full.stats


def test_verify_campaigns_go_on_until_their_edges_are_reached(monkeypatch) -> None:
    """The wiring in ``kvspec verify``: with a budget too short to reach the
    ring's edges, the check still passes (it searched on, up to
    REACH_FACTOR budgets); with no room to go on it fails NOT REACHED."""
    from kvspec.fuzz.commands import verify

    monkeypatch.setattr(verify, "REACH_FACTOR", 10**6)
    [check] = verify.check_campaigns(1e-4, ("rotating", "fp16", True))
    assert check.ok, check.detail
    monkeypatch.setattr(verify, "REACH_FACTOR", 0)
    [check] = verify.check_campaigns(1e-4, ("rotating", "fp16", True))
    assert not check.ok and "NOT REACHED" in check.detail, check.detail

"""``campaign(..., fit=True)`` (``kvspec verify``'s campaigns): the batch
that would run past the budget is cut to the examples that fit, so the
search stops at its budget; whole batches while a ``reach`` event is
missing. A stand-in for :class:`kvspec.fuzz.campaign.Campaign` whose examples
each take 0.1 s of search, so no clock is read."""

from __future__ import annotations

from typing import ClassVar

import pytest

import kvspec.fuzz.campaign as fc


class FakeCampaign:
    """Examples of 0.1 s each; ``reach_after``: the example from which the
    event ``edge`` counts as reached."""

    reach_after = 0
    sweep = None
    sizes: ClassVar[list[int]] = []

    def __init__(self, kind, mode, inplace, seed, factories=None, batch=25, *a, **k):
        self.batch_size = batch
        self.report = fc.CampaignReport("fake", 0.0, 0, 0, {})
        FakeCampaign.sizes = []

    @property
    def failed(self) -> bool:
        return False

    def batch(self, budget=None):
        size = self.batch_size if self.sweep is None else max(1, self.batch_size // len(self.sweep[1]))
        FakeCampaign.sizes.append(size)
        self.report.batches += 1
        self.report.examples += size
        self.report.seconds = round(self.report.seconds + 0.1 * size, 6)
        if self.report.examples >= self.reach_after:
            self.report.stats["edge"] = 1
        return self.report


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(fc, "Campaign", FakeCampaign)
    FakeCampaign.reach_after, FakeCampaign.sweep = 0, None
    return FakeCampaign


def test_whole_batches_run_past_the_budget(fake):
    rep = fc.campaign("dense", "fp16", True, 6.0, 1)
    assert fake.sizes == [25, 25, 25] and rep.seconds == pytest.approx(7.5)


def test_fit_stops_the_search_at_its_budget(fake):
    rep = fc.campaign("dense", "fp16", True, 6.0, 1, fit=True)
    assert fake.sizes == [25, 25, 10] and rep.seconds == pytest.approx(6.0)


def test_fit_runs_at_least_one_example_and_never_more_than_a_batch(fake):
    rep = fc.campaign("dense", "fp16", True, 2.51, 1, fit=True)
    assert fake.sizes == [25, 1] and rep.seconds == pytest.approx(2.6)
    rep = fc.campaign("dense", "fp16", True, 100.0, 1, fit=True)
    assert max(fake.sizes) == 25 and rep.seconds == pytest.approx(100.0)


def test_fit_keeps_whole_batches_while_an_edge_is_missing(fake):
    fake.reach_after = 70  # reached in the third batch, past the budget
    rep = fc.campaign("dense", "fp16", True, 4.0, 1, reach=("edge",), reach_budget=100.0, fit=True)
    assert fake.sizes == [25, 25, 25] and rep.stats["edge"]


def test_fit_counts_a_sweeps_examples_per_batch(fake):
    fake.sweep = ("undo", (0, 1, 2, 4, 8))  # a batch of 25 runs 5 examples
    rep = fc.campaign("dense", "fp16", True, 1.25, 1, fit=True)
    assert fake.sizes == [5, 5, 3] and rep.seconds == pytest.approx(1.3)

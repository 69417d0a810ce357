"""Every injected bug is caught by the fuzzer from a fixed seed, and its
minimal trace passes on the real implementation (no false alarm)."""

import pytest

from fuzz.bugs import catalog
from fuzz.campaign import catch_bug


@pytest.mark.parametrize("bug", catalog(), ids=lambda b: b.name)
def test_injected_bug_is_caught(bug, tmp_path):
    caught, _seconds, examples, path, alarm = catch_bug(bug, seed=1, max_examples=1000, out_dir=tmp_path)
    assert caught, f"{bug.name} missed after {examples} examples"
    assert alarm is None, alarm
    assert path is not None and path.exists()


def test_catalog_names_are_unique_and_documented():
    bugs = catalog()
    assert len({b.name for b in bugs}) == len(bugs)
    for b in bugs:
        assert b.clause and b.source and b.replaces and b.description and b.factories

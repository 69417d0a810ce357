"""kvspec verify -j: the same checks, order and verdicts on a process pool
as in one process; a crashing job is a failed check, not a crash."""

from fuzz.commands import verify


def names_and_verdicts(results: dict[int, list[verify.Check]], n: int) -> list[tuple[str, bool]]:
    return [(c.name, c.ok) for i in range(n) for c in results[i]]


def test_pool_and_inline_agree():
    jobs = [verify.Job("equivalents", "check_equivalents", (), 1.0),
            verify.Job("traces", "check_traces", (), 5.0),
            verify.Job("broken", "no_such_check", (), 9.0)]
    quiet = verify.Progress(len(jobs), quiet=True)
    inline = verify.run_jobs(jobs, 1, quiet)
    pooled = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    assert names_and_verdicts(inline, 3) == names_and_verdicts(pooled, 3)
    got = names_and_verdicts(pooled, 3)
    assert got[-1] == ("broken", False) and sum(ok for _, ok in got) == len(got) - 1
    assert len(got) > 30  # every trace and equivalence, not a vacuous plan


def test_the_plan_covers_every_check_once():
    from fuzz import kinds
    from fuzz.bugs import catalog

    plan = verify.plan(quick=False)
    labels = [j.label for j in plan]
    assert len(labels) == len(set(labels))
    assert sum(label.startswith("bug ") for label in labels) == len(catalog())
    assert sum(label.startswith("fuzz ") for label in labels) == sum(len(k.campaigns) for k in kinds.KINDS.values())
    assert {"traces", "proofs", "crosshair", "equivalent mutants"} <= set(labels)
    assert verify.plan(quick=True, skip_proofs=True)[-1].label.startswith("bug ")

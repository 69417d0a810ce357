"""kvspec verify -j: the same checks, order and verdicts on a process pool
as in one process; a crashing job is a failed check, not a crash."""

from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.commands import verify


def names_and_verdicts(results: dict[int, list[verify.Check]], n: int) -> list[tuple[str, bool]]:
    return [(c.name, c.ok) for i in range(n) for c in results[i]]


def test_pool_and_inline_agree():
    jobs = [verify.Job("equivalents", "check_equivalents", (), 1.0),
            verify.Job("traces", "check_traces", (), 5.0),
            verify.Job("broken", "no_such_check", (), 9.0)]
    verify.run_jobs(jobs, 1, verify.Progress(len(jobs), quiet=True))  # imports done, as in a warm worker
    quiet = verify.Progress(len(jobs), quiet=True)
    inline = verify.run_jobs(jobs, 1, quiet)
    pool_progress = verify.Progress(len(jobs), quiet=True)
    pooled = verify.run_jobs(jobs, 2, pool_progress)
    assert names_and_verdicts(inline, 3) == names_and_verdicts(pooled, 3)
    # each job's CPU seconds come back with its checks, inline and from the
    # pool's warm processes (where the parent itself only waits): the same
    # work, so the pool's count is not far below the inline one. Not an
    # absolute figure: the traces replay in 0.6 s of CPU on one machine, 2 s
    # on another
    assert quiet.cpu > 0.1
    assert pool_progress.cpu > 0.5 * quiet.cpu
    got = names_and_verdicts(pooled, 3)
    assert got[-1] == ("broken", False) and sum(ok for _, ok in got) == len(got) - 1
    assert len(got) > 30  # every trace and equivalence, not a vacuous plan


def test_the_plan_covers_every_check_once():
    from kvspec.fuzz import kinds
    from kvspec.fuzz.bugs import catalog, runnable

    plan = verify.plan(quick=False)
    labels = [j.label for j in plan]
    assert len(labels) == len(set(labels))
    assert sum(label.startswith("bug ") for label in labels) == len([b for b in catalog() if runnable(b)])
    assert sum(label.startswith("fuzz ") for label in labels) == sum(len(k.campaigns) for k in kinds.KINDS.values())
    assert {"traces", "crosshair diffbehavior", "equivalent mutants"} <= set(labels)
    assert verify.plan(quick=True, skip_proofs=True)[-1].label.startswith("bug ")


def test_the_proofs_are_one_job_per_obligation_and_per_contract_file():
    # split so that the pool balances them (one proofs job was the critical path)
    from kvspec.proofs import crosshair_run
    from kvspec.proofs.cli import TITLES, obligations

    jobs = verify.proof_jobs()
    numbers = sorted({n for n, _ in obligations()})
    assert [j.args for j in jobs if j.func == "check_obligation"] == [(n,) for n in numbers]
    assert [j.label for j in jobs if j.func == "check_obligation"] == [f"proof {TITLES[n]}" for n in numbers]
    files = [str(p.relative_to(crosshair_run.ROOT)) for p in crosshair_run.contract_files()]
    assert [j.args for j in jobs if j.func == "check_crosshair_file"] == [(f,) for f in files]
    assert [j.func for j in jobs].count("check_crosshair_diff") == 1
    assert all(j.label in {k.label for k in verify.plan()} for j in jobs)
    # every expected time is a measured one (a missing entry would run it late)
    assert set(verify.PROOF_SECONDS) >= set(numbers) and set(verify.CROSSHAIR_SECONDS) >= set(files)


def test_an_obligation_job_fails_when_a_negative_control_survives(monkeypatch):
    from kvspec.proofs import dense
    from kvspec.proofs.dense_model import Rules

    (good,) = verify.check_obligation(5)
    assert good.ok and good.name == "proof front trim" and good.detail.startswith("proved, negative control refuted; Z3 units")
    # check_obligation runs the obligation in a process of its own; its work, obligation_checks, runs here
    assert [(c.name, c.ok) for c in verify.obligation_checks(5)] == [(good.name, True)]
    monkeypatch.setattr(dense, "FRONT_CONTROLS", [("not_a_bug", "the spec itself", Rules())])
    (bad,) = verify.obligation_checks(5)
    assert not bad.ok and "control not_a_bug: not refuted" in bad.detail
    # the job's own process starts from the installed modules, never from this process's state
    (fresh,) = verify.check_obligation(5)
    assert fresh.ok, fresh.detail
    (missing,) = verify.check_obligation(99)
    assert not missing.ok and "no obligation numbered 99" in missing.detail


def test_a_crosshair_file_job_fails_on_a_counterexample(tmp_path):
    bad = tmp_path / "bad_contract.py"
    bad.write_text('def grow(x: int) -> int:\n    """\n    pre: x >= 0\n    post: __return__ > x\n    """\n    return x\n')
    (check,) = verify.check_crosshair_file(str(bad))
    assert not check.ok and "counterexamples 1" in check.detail
    good = tmp_path / "good_contract.py"
    good.write_text(bad.read_text().replace("return x", "return x + 1"))
    (check,) = verify.check_crosshair_file(str(good))
    assert check.ok and "confirmed 1" in check.detail and not check.warnings


# -- what verify and mutants ask of the fuzzer (seeds, budgets, shrinking) ---------
def test_full_plan_fuzzes_each_bug_from_five_seeds_and_campaigns_for_the_budget():
    plan = verify.plan(quick=False, skip_proofs=True)
    bugs = [j for j in plan if j.func == "check_bugs"]
    assert bugs and all(j.args[1] == 5 for j in bugs)
    campaigns = [j for j in plan if j.func == "check_campaigns"]
    assert campaigns and all(j.args[0] == verify.CAMPAIGN_BUDGET for j in campaigns)
    quick = verify.plan(quick=True, skip_proofs=True)
    assert all(j.args[1] == 1 for j in quick if j.func == "check_bugs")


def test_verify_never_shrinks_and_mutants_shrinks_seed_one_only(monkeypatch, tmp_path):
    from kvspec.fuzz.campaign import Catch
    from kvspec.fuzz.commands import mutants

    calls: list[tuple[int, bool]] = []

    def fake_catch(bug, seed, max_examples, out_dir, fixed=None, check_inplace=True, stem=None, shrink=True):
        calls.append((seed, shrink))
        return Catch(True, 0.1, 1, None, None)

    monkeypatch.setattr(mutants, "catch_bug", fake_catch)
    name = mutants.catalog()[0].name
    mutants.run_mutants(3, out=str(tmp_path), names=[name])
    assert calls and {s: sh for s, sh in calls} == {1: True, 2: False, 3: False}
    calls.clear()
    verify.check_bugs(str(tmp_path), 3, [name])
    assert calls and not any(sh for _, sh in calls)


def test_run_machine_passes_shrink_to_hypothesis(monkeypatch):
    from hypothesis import Phase

    from kvspec.fuzz import campaign

    seen = []
    real = campaign.fuzz_settings

    def spy(*args, **kw):
        s = real(*args, **kw)
        seen.append(tuple(s.phases))
        return s

    monkeypatch.setattr(campaign, "fuzz_settings", spy)
    machine = campaign.machine_for("dense", "fp16")
    campaign.run_machine(machine, seed=1, max_examples=1, steps=2, shrink=False)
    campaign.run_machine(machine, seed=1, max_examples=1, steps=2)
    assert seen == [(Phase.generate,), (Phase.generate, Phase.shrink)]


def test_a_job_past_its_wall_clock_limit_fails_naming_it_instead_of_hanging(monkeypatch):
    import time

    monkeypatch.setenv("KVSPEC_VERIFY_JOB_LIMIT", "3")
    jobs = [verify.Job("fuzz dense/fp16/copy", "check_campaigns", (120.0, ("dense", "fp16", False)), 123.0),
            verify.Job("equivalents", "check_equivalents", (), 1.0)]
    start = time.perf_counter()
    results = verify.run_jobs(jobs, 2, verify.Progress(len(jobs), quiet=True))
    assert time.perf_counter() - start < 60
    (stopped,) = results[0]
    assert not stopped.ok and stopped.name == "fuzz dense/fp16/copy"
    assert "wall-clock limit of 3 s" in stopped.detail and "fuzz dense/fp16/copy" in stopped.detail
    assert results[1] and all(c.ok for c in results[1])


def test_every_job_has_a_limit_above_its_expected_time():
    for quick in (False, True):
        seeds = 1 if quick else 5
        for job in verify.plan(quick=quick):
            if job.label.startswith("bug "):
                # a bug job's limit follows its own size: seeds x variants x
                # a per-seed allowance (a fixed floor that a slower device
                # passed killed old_regrow_guard on the GPU)
                bug = by_name(job.label[4:])
                assert verify.job_limit(job) == verify.BUG_SEED_SECONDS * seeds * (1 + len(bug.variants)), job.label
                assert verify.job_limit(job) >= 2 * job.weight, job.label
            else:
                assert verify.job_limit(job) >= max(120.0, 2 * job.weight), job.label


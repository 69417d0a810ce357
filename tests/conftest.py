"""Test configuration: a deterministic Hypothesis profile for CI.

``derandomize`` makes every run of the suite draw the same examples, and no
example database is kept, so a CI result depends on the code alone. Campaigns
(``kvspec fuzz``) are where randomness belongs.

``HYPOTHESIS_PROFILE=mutation`` (set by ``make mutation``) is the same
profile without the shrink phase and with a third of the examples: a mutant
is killed by the first failing example, and minimising that example only
costs time per mutant (it is what made most mutmut runs hit their timeout),
while a surviving mutant runs every example of every test that reaches it.
Tests that set their own budget scale it with :func:`tests.budget.examples`
(docs/mutation.md has the measured effect).

The ``kvspec fuzz`` runs the tests start (in process or as a subprocess)
inherit ``KVSPEC_DB=none`` unless the environment sets it: without it they
would share the default example database ``.hypothesis/kvspec-examples`` in
the checkout, so a failure one test saved would replay first in another and
a result would depend on which tests ran before (and, under pytest-xdist, on
which worker ran them). Tests of the database pass ``--db`` themselves.
"""

import os
import signal

import pytest
from hypothesis import HealthCheck, Phase, settings

TRACES_KEY = pytest.StashKey[dict]()

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    stateful_step_count=30,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)
settings.register_profile(
    "mutation", settings.get_profile("ci"), max_examples=20,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
os.environ.setdefault("KVSPEC_DB", "none")
# A suite started in the background of a non-interactive shell (`make test &`,
# `( .ci/run & )`) inherits SIGINT ignored, and so would every child it
# starts: the tests that press Ctrl-C on a `kvspec fuzz` or `kvspec campaign`
# child would wait for an exit that never comes. Give Ctrl-C back its
# default meaning, as in a terminal (children then start with it too).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: Files whose tests share no module fixture and no state: under ``make
#: test``'s ``--dist loadfile`` each of their tests goes to whichever worker
#: is free (test_bugs.py alone would otherwise hold one core for minutes).
#: Every other file runs whole on one worker, in file order, so its module
#: fixtures (the proofs run, the browser, the compiled adapters) are built
#: once.
SPREAD = frozenset({"test_bugs.py", "test_reports.py", "test_e2e.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that a test of a :data:`SPREAD` file is
    a unit of its own. (Not ``--dist loadgroup`` with ``xdist_group``
    marks: pytest-xdist 3.8 groups by rewriting ``item._nodeid``, which
    pytest 9 no longer reads, so the marks are silently ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesOrSpreadTests(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.rsplit("/", 1)[-1] in SPREAD else path

    return FilesOrSpreadTests(config, log)


#: where the recorded-trace tests count their replays (module attribute
#: DONE: ours, and the engine's own where it is installed), by engine
TRACES_MODULES = {"transformers": "tests.test_transformers_traces", "llama.cpp": "tests.test_llama_cpp_target",
                  "vllm": "tests.test_vllm_target"}
#: what installs each engine (an optional extra, or a script where an extra cannot)
EXTRAS = {"transformers": "PyTorch/transformers not installed: optional extra 'transformers'",
          "llama.cpp": "llama-cpp-python not installed: optional extra 'llama-cpp'",
          "vllm": "vLLM not installed: tools/install-vllm, or make vllm"}


def traces_done() -> dict[str, int]:
    """This process's replay counts, keyed ``engine/ours`` and
    ``engine/engine`` (zero where the module did not run)."""
    import sys

    out = {}
    for engine, name in TRACES_MODULES.items():
        mod = sys.modules.get(name)
        done = dict(mod.DONE) if mod is not None else {}
        out[f"{engine}/ours"] = done.get("ours", 0)
        out[f"{engine}/engine"] = done.get(engine, 0)
    return out


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker hands its counts to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["kvspec_traces_done"] = traces_done()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up each worker's counts (pytest-xdist hook; only
    called where xdist is running)."""
    got = getattr(node, "workeroutput", {}).get("kvspec_traces_done", {})
    total = node.config.stash.setdefault(TRACES_KEY, {})
    for key, n in got.items():
        total[key] = total.get(key, 0) + n


def pytest_terminal_summary(terminalreporter):
    """Say which engines the recorded engine traces were replayed on
    (tests/test_transformers_traces.py, tests/test_llama_cpp_target.py,
    tests/test_vllm_target.py): ours always, the engine's own where it is
    installed."""
    done = terminalreporter.config.stash.get(TRACES_KEY, None) or traces_done()
    for engine in TRACES_MODULES:
        ours, theirs = done.get(f"{engine}/ours", 0), done.get(f"{engine}/engine", 0)
        if not ours and not theirs:
            continue
        on = f"and against {engine} ({theirs})" if theirs else f"only ({EXTRAS[engine]})"
        terminalreporter.write_line(f"kvspec: recorded {engine} traces replayed against our caches ({ours}) {on}")

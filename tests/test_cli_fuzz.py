"""The kvspec command under bad input: every malformed trace and argument
vector exits 2 with a one-line reason, never a traceback and never a hang.

Each case runs the command on a warm worker (tests/warm_cli.py: its exit
status, stdout and stderr as a child process would give them) with a time
box, so a hang fails the test instead of the suite; one test runs real
``python -m kvspec.fuzz.commands.cli`` processes, so that the status a process
exits with is the one checked. The explicit cases are the ones users hit;
Hypothesis draws more (damaged traces, bad flag values).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import warm_cli

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 90  # seconds per case: generous for a loaded 2-core machine; a hang exceeds it
GOOD = {"kvtrace": 1, "cache": {"kind": "rotating", "max_size": 4, "keep": 1, "step": 2},
        "ops": [{"op": "append", "n": 3}, {"op": "snapshot", "name": "s"}, {"op": "append", "n": 1},
                {"op": "expect", "of": "s", "window": [0, 1, 2]}]}


def kvspec(*argv: str) -> subprocess.CompletedProcess:
    return warm_cli.kvspec(*argv, env={**os.environ, "COLUMNS": "100"}, timeout=TIMEOUT)


def child(*argv: str) -> subprocess.CompletedProcess:
    """``kvspec ARGV`` as a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)


def clean_refusal(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 2, out
    assert out.strip(), "exit 2 without a message"
    return out


def trace_file(tmp_path: Path, content: bytes | str | dict, name: str = "t.json") -> str:
    p = tmp_path / name
    if isinstance(content, dict):
        content = json.dumps(content)
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(p)


BAD_TRACES = {
    "n 10**12": {"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 10**12}]},
    "n 10**30": {"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 10**30}]},
    "head_dim 10**9": {"kvtrace": 1, "cache": {"kind": "dense", "head_dim": 10**9}, "ops": [{"op": "append", "n": 1}]},
    "step 10**12": {"kvtrace": 1, "cache": {"kind": "dense", "step": 10**12}, "ops": [{"op": "append", "n": 1}]},
    "op without op": {"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"as": "x"}]},
    "unknown op": {"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "fork", "from": "main", "as": "b"}]},
    "expect unknown name": {"kvtrace": 1, "cache": {"kind": "dense"},
                            "ops": [{"op": "append", "n": 1}, {"op": "expect", "of": "nope", "window": [0]}]},
    "keep >= max_size": {"kvtrace": 1, "cache": {"kind": "rotating", "max_size": 2, "keep": 2}, "ops": []},
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "not UTF-8": b'{"kvtrace": 1, "cache": {"kind": "\xff"}, "ops": []}',
    "duplicate keys": '{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [], "ops": []}',
    "NaN": '{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "trim", "n": NaN}]}',
    "prefix unknown req": {"kvtrace": 1, "cache": {"kind": "prefix", "block_size": 2, "n_blocks": 4, "window": None},
                           "ops": [{"op": "free", "req": "a"}]},
    "prefix negative token": {"kvtrace": 1, "cache": {"kind": "prefix", "block_size": 2, "n_blocks": 4, "window": None},
                              "ops": [{"op": "admit", "req": "a", "tokens": [-1]}]},
    "prefix block_size 0": {"kvtrace": 1, "cache": {"kind": "prefix", "block_size": 0, "n_blocks": 4, "window": None},
                            "ops": []},
    "prefix slabs 2**40": {"kvtrace": 1, "cache": {"kind": "prefix", "block_size": 2**20, "n_blocks": 2**20,
                                                   "window": None}, "ops": [{"op": "admit", "req": "a", "tokens": [1]}]},
    "truncated": json.dumps(GOOD)[:40],
    "empty file": "",
}


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_bad_traces_exit_2(tmp_path, case):
    out = clean_refusal(kvspec("replay", trace_file(tmp_path, BAD_TRACES[case])))
    assert out.startswith("invalid kvtrace"), out


BAD_ARGV = [
    ["fuzz", "--bug", "nosuch"],
    ["fuzz", "--budget", "nan"],
    ["fuzz", "--budget", "inf"],
    ["fuzz", "--budget", "0"],
    ["fuzz", "--budget", "-5"],
    ["fuzz", "--seeds", "3"],
    ["fuzz", "--kind", "nosuch"],
    ["fuzz", "--kind", "paged", "--mode", "int8"],
    ["fuzz", "--bug", "steady_state_inplace", "--kind", "dense"],
    ["mutants", "--seeds", "0"],
    ["mutants", "--only", "nosuch"],
    ["replay", "tests/traces/format_example.json", "--bug", "nosuch"],
    ["replay", "tests/traces/format_example.json", "--bug", "steady_state_inplace"],
    ["replay", "does/not/exist.json"],
    ["replay", "spec"],  # a folder with no kvtrace in it
    ["replay"],
    ["verify", "-j", "0"],
    ["conformance", "--budget", "0"],
    ["conformance", "--class", "NoSuchCache", "--budget", "1"],
    ["conformance", "--target", "llama.cpp", "--budget", "5"],
    ["conformance", "--target", "llama.cpp", "--sarif", "out.sarif"],
    ["fuzz", "--target", "llama.cpp", "--budget", "1"],
    ["e2e", "--only", "nosuch"],
    ["e2e", "--bug", "nosuch"],
    ["bench", "--contexts", "0"],
    ["nosuch"],
    [],
]


def test_a_process_exits_with_the_status_the_command_gives(tmp_path):
    """What the other tests read from a warm worker, a real process gives:
    exit 2 and the reason, for a bad trace (the command's own refusal) and
    a bad argument (argparse's), and a --version that exits 0."""
    trace = clean_refusal(child("replay", trace_file(tmp_path, BAD_TRACES["NaN"])))
    assert trace.startswith("invalid kvtrace"), trace
    assert "invalid choice: 'nosuch'" in clean_refusal(child("fuzz", "--kind", "nosuch"))
    version = child("--version")
    assert version.returncode == 0 and version.stdout == kvspec("--version").stdout


@pytest.mark.parametrize("argv", BAD_ARGV, ids=[" ".join(a) or "(none)" for a in BAD_ARGV])
def test_bad_arguments_exit_2(argv):
    out = clean_refusal(kvspec(*argv))
    if "nosuch" in argv and argv[0] in ("fuzz", "mutants", "replay") and "--kind" not in argv:
        assert "kvspec mutants --list" in out  # where the valid names are listed
    if argv[:3] == ["fuzz", "--kind", "nosuch"]:
        assert "choose from 'dense', 'rotating'" in out
    if argv[:3] == ["conformance", "--target", "llama.cpp"]:
        assert f"{argv[3]}: does not apply to --target llama.cpp" in out
    if argv[:3] == ["fuzz", "--target", "llama.cpp"]:
        assert "kvspec conformance --target llama.cpp" in out and "reached:" not in out


def test_conformance_help_names_every_target_and_its_budget():
    text = " ".join(kvspec("conformance", "--help").stdout.split())
    assert "mlx-lm class" not in text and "llama_kv_cache" in text and "--target llama.cpp" in text
    assert "does not apply to the target exits 2" in text


@pytest.mark.parametrize("kind", ["cells", "recurrent", "prefix", "dense"])
def test_a_kind_without_the_inplace_switch_runs_one_campaign(kind, monkeypatch, capsys):
    """KV_INPLACE_WRITE changes nothing for these kinds (Kind.inplace_switch
    False): one campaign, not the same one twice (inplace and copy); dense,
    whose writes it changes, runs both. The campaigns the command builds
    are recorded instead of run (their search is not what is checked here;
    the recurrent one runs for real below)."""
    from kvspec.fuzz import campaign, kinds
    from kvspec.fuzz.commands.cli import main

    assert kinds.get(kind).inplace_switch is (kind == "dense")
    built: list[str] = []

    def interleaved(runs, budget, progress=None):
        for r in runs:
            built.append(r.report.config)
            r.report.batches, r.report.examples = 1, 1
        return [r.report for r in runs]

    monkeypatch.setattr(campaign, "interleaved", interleaved)
    assert main(["fuzz", "--kind", kind, "--mode", "fp16", "--budget", "0.5", "--seed", "3", "--json"]) == 0
    want = [f"{kind}/fp16/inplace"] + ([f"{kind}/fp16/copy"] if kind == "dense" else [])
    assert built == want and [r["config"] for r in json.loads(capsys.readouterr().out)["runs"]] == want


def test_a_kind_without_the_inplace_switch_runs_its_campaign_for_real():
    proc = kvspec("fuzz", "--kind", "recurrent", "--budget", "0.5", "--seed", "3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(proc.stdout)["runs"]
    assert [r["config"] for r in runs] == ["recurrent/fp16/inplace"] and runs[0]["examples"] > 0


def test_help_names_defaults_exit_codes_and_bugs():
    proc = kvspec("fuzz", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "(default: 60)" in text and "exit status: 0" in text and "130 interrupted" in text
    assert "kvspec mutants --list" in text
    version = kvspec("--version")
    assert version.returncode == 0 and version.stdout.startswith("kvspec ")


def test_a_tiny_budget_still_checks_something():
    proc = kvspec("fuzz", "--kind", "dense", "--mode", "int8", "--budget", "1e-9", "--seed", "5", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and all(r["examples"] > 0 for r in doc["runs"])
    assert proc.stderr.startswith("kvspec fuzz: seed 5")


# -- drawn cases -------------------------------------------------------------------
@st.composite
def damaged_traces(draw) -> bytes:
    """A valid trace damaged one way: a value replaced, bytes cut or
    flipped, a key duplicated."""
    doc = json.loads(json.dumps(GOOD))
    how = draw(st.sampled_from(["value", "cut", "flip", "dup"]))
    text = json.dumps(doc)
    if how == "value":
        where = draw(st.sampled_from(["cache.max_size", "cache.keep", "cache.step", "cache.kind", "ops.0.n",
                                      "ops.3.of", "ops.3.window", "ops.1.name", "ops.0", "kvtrace", "ops"]))
        bad = draw(st.one_of(st.sampled_from([0, -1, 10**12, 10**40, 1.5, True, None, "", "x" * 300, [], {}]),
                             st.text(max_size=5)))
        node = doc
        parts = where.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = bad
        else:
            node[last] = bad
        return json.dumps(doc).encode()
    if how == "cut":
        return text.encode()[: draw(st.integers(0, len(text) - 1))]
    if how == "flip":
        data = bytearray(text.encode())
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.sampled_from([0x00, 0x7B, 0x5B, 0x22, 0xFF, 0xC3]))
        return bytes(data)
    return text.replace('"step": 2', '"step": 2, "step": 3').encode()


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(damaged_traces())
def test_damaged_traces_never_crash(tmp_path_factory, data):
    path = trace_file(tmp_path_factory.mktemp("cli"), data)
    proc = kvspec("replay", path)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode in (0, 1, 2, 3), out
    if proc.returncode == 2:
        assert out.startswith("invalid kvtrace"), out


NUMERIC = {"fuzz": ["--budget", "--seed"], "mutants": ["--seeds"], "conformance": ["--budget", "--seed", "--max-findings"],
           "verify": ["-j"], "bench": ["--contexts"]}


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted((c, f) for c, fs in NUMERIC.items() for f in fs)),
       st.sampled_from(["nan", "inf", "-inf", "-1", "0", "", "abc", "1e400", "9" * 50, "0x10", "1.5"]))
def test_bad_numbers_never_start_work(command_flag, value):
    command, flag = command_flag
    if flag in ("--seed",) and value in ("0",):
        value = "-1"  # 0 is a valid seed
    if flag == "--budget" and value == "1.5":
        value = "-1.5"  # 1.5 s is a valid budget
    clean_refusal(kvspec(command, f"{flag}={value}"))


# -- the ops/s column: a figure only where a run measured one (issue 47) ---------------
def test_ops_per_second_is_a_dash_for_a_failed_or_empty_campaign():
    from kvspec.fuzz.commands.cli import _ops_per_second

    row = {"result": "ok", "steps": 1000, "seconds": 2.0}
    assert _ops_per_second(row) == "500"
    # a failure found at once: its seconds are the moments before it, not a throughput
    assert _ops_per_second({**row, "result": "FAILED", "seconds": 0.003}) == "-"
    assert _ops_per_second({**row, "result": "no examples", "steps": 0, "seconds": 2.0}) == "-"
    assert _ops_per_second({**row, "steps": 0}) == "-"
    assert _ops_per_second({**row, "seconds": 0.0}) == "-"


def test_a_failed_campaign_s_row_shows_no_rate(tmp_path, capsys):
    from kvspec.fuzz.commands.cli import main

    code = main(["fuzz", "--bug", "steady_state_inplace", "--inplace", "on", "--budget", "3", "--shrink-budget",
                 "0.5", "--db", "none", "--seed", "1", "--out", str(tmp_path)])
    assert code == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "rotating/fp16/inplace" in line and "FAILED" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[0] == "rotating/fp16/inplace" and cells[3] == "-", cells

"""kvproto/2 (docs/kvproto.md): rings over the line protocol, with the
reference ring adapter in C (adapters/c/kvspec_ring.c), built here with
``cc``.

The ring adapter passes every rotating trace of tests/traces/ (its
subfolders included) over kvproto/2, in both window forms; its planted bug
(``-DKVSPEC_RING_WRAP_BUG``: the cursor wraps one slot too far) fails them,
and ``kvspec fuzz --target`` finds it and shrinks it to a trace of a few
ops. Planted misreports of each ring observable and of the masks are each
a divergence at the op they start at; an adapter that leaves out the masks
it was asked for breaks the protocol. A kvproto/1 adapter still runs as
before and is never sent a kvproto/2 field; a kvproto/2 hello with a kind,
cache field, op or observable that is not the kind's is a usage error
(exit 2, one line)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import load, loads

REPO = Path(__file__).resolve().parent.parent
RING = REPO / "adapters" / "c" / "kvspec_ring.c"
DENSE = REPO / "adapters" / "c" / "kvspec_dense.c"


def rotating_traces() -> list[Path]:
    out = []
    for path in sorted((REPO / "tests" / "traces").rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("cache"), dict) and doc["cache"].get("kind") == "rotating":
            out.append(path)
    return out


#: planted variants of the ring adapter: name -> (compile flags, edits of
#: its source: a line and its replacement, each matching exactly once)
VARIANTS: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    "good": ([], []),
    # the planted bug the source carries: the cursor wraps to K + 1, not K
    "wrap": (["-DKVSPEC_RING_WRAP_BUG"], []),
    # make_mask's window one key too wide (a query sees window + 1 keys)
    "mask_wide": ([], [("    return key <= query && (key < G.K || query - key < window - G.K);\n",
                        "    return key <= query && (key < G.K || query - key <= window - G.K);\n")]),
    # answers an append without the masks it was asked for
    "no_masks": ([], [("put_masks(masks, (int)n);\n", "{ if (0) put_masks(masks, (int)n); }\n")]),
    # each observable misreported on its own
    "idx": ([], [('           "\\"log_saved_rows\\":%d,\\"cache\\":", r->offset, r->idx,',
                  '           "\\"log_saved_rows\\":%d,\\"cache\\":", r->offset, r->idx + (r->offset != r->idx),')]),
    "trimmable_rows": ([], [("           trimmable_rows(r), log_saved_rows(r));\n",
                             "           trimmable_rows(r) + (r->nlog > 1), log_saved_rows(r));\n")]),
    "log_saved_rows": ([], [("           trimmable_rows(r), log_saved_rows(r));\n",
                             "           trimmable_rows(r), log_saved_rows(r) + (r->nlog > 1));\n")]),
    "trimmable": ([], [("r->cap, is_trimmable(r) ? \"true\" : \"false\",",
                        "r->cap, (is_trimmable(r) || r->offset > G.W) ? \"true\" : \"false\",")]),
    "capacity": ([], [("r->offset, r->idx, r->cap, is_trimmable(r)", "r->offset, r->idx, r->cap + (r->cap > G.W), is_trimmable(r)")]),
    # a rollback through the undo log forgets the row a decode overwrote
    "undo_decode": ([], [("        if (rec->nsaved) s[rec->slot] = rec->saved[0];\n", "")]),
    # the hello declares a kind kvproto/2 does not have, a field, an op or an observable not the ring's
    "bad_kind": ([], [('"\\"kinds\\":{\\"rotating\\":', '"\\"kinds\\":{\\"ring\\":')]),
    "bad_field": ([], [('"max_size", "keep", "undo", NULL};', '"max_size", "keep", "undo", "window", NULL};')]),
    "bad_op": ([], [('\\"copy\\",\\"reload\\"]', '\\"copy\\",\\"reload\\",\\"rewind\\"]')]),
    "bad_observable": ([], [('\\"inplace\\",\\"masks\\"]', '\\"inplace\\",\\"masks\\",\\"live_len\\"]')]),
    # the ring answers as kvproto/1, which drives dense caches only
    "as_v1": ([], [('\\"kvproto\\":2,\\"adapter', '\\"kvproto\\":1,\\"adapter')]),
}


def compile_command(out: Path, name: str) -> list[str]:
    """The ``cc`` command that builds variant ``name`` (its source written to ``out``)."""
    flags, edits = VARIANTS[name]
    src = RING.read_text()
    for old, new in edits:
        assert src.count(old) == 1, f"the line variant {name} patches is not in the adapter once: {old!r}"
        src = src.replace(old, new)
    path = out / f"ring_{name}.c"
    path.write_text(src)
    cc = shutil.which("cc")
    assert cc is not None, "the C adapters' tests need a C compiler (cc)"
    return [cc, "-std=c99", "-O0", "-Wall", "-Wextra", "-Werror", *flags, "-o", str(out / f"ring_{name}"), str(path)]


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every variant, and the dense reference adapter, compiled at once."""
    out = tmp_path_factory.mktemp("rings")
    commands = {name: compile_command(out, name) for name in VARIANTS}
    commands["dense"] = [commands["good"][0], "-std=c99", "-O0", "-o", str(out / "ring_dense"), str(DENSE)]
    # the dense adapter (kvproto/1) with a ring's cursor in its state: a field kvproto/1 does not have
    src = DENSE.read_text()
    old = 'printf(",\\"state\\":{\\"offset\\":%d,'
    assert src.count(old) == 1
    (out / "dense_idx.c").write_text(src.replace(old, 'printf(",\\"state\\":{\\"idx\\":0,\\"offset\\":%d,'))
    commands["dense_idx"] = [commands["good"][0], "-std=c99", "-O0", "-o", str(out / "ring_dense_idx"),
                             str(out / "dense_idx.c")]
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate()
        assert proc.returncode == 0, f"{name} does not compile: {output}"
    yield {name: str(out / f"ring_{name}") for name in commands}
    ex.close_sessions()


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out + got.err


# -- the reference ring adapter ---------------------------------------------------


@pytest.mark.parametrize("windows", ["bytes", "identities"])
def test_ring_adapter_passes_every_rotating_trace(rings, windows):
    """Every rotating trace, none refused: undo logs, state snapshots,
    reloads, refusals and masks included; nothing left uncompared."""
    target = resolve(f"exec:{rings['good']} --windows {windows}")
    assert target.version == 2 and target.windows == windows
    traces = rotating_traces()
    assert len(traces) >= 30, traces
    masks = 0
    for path in traces:
        result = replay(load(path), target=target)
        assert result.ok, f"{path.relative_to(REPO)}: {result.divergence}"
        assert result.not_compared == [], (path.name, result.not_compared)
        masks += result.stats.get("masks checked", 0)
    assert masks >= len(traces), masks  # before (nearly) every append


def test_the_masks_are_compared(rings):
    """A trace whose appends ask for masks reports them checked."""
    result = replay(load(REPO / "tests" / "traces" / "mask_hides_sinks.json"), target=resolve(f"exec:{rings['good']}"))
    assert result.ok and result.stats.get("masks checked", 0) >= 1, result.stats


def test_the_planted_wrap_bug_fails_the_traces(rings):
    target = resolve(f"exec:{rings['wrap']}")
    failed = [p.name for p in rotating_traces() if not replay(load(p), target=target).ok]
    assert "rotating_worked_example.json" in failed and len(failed) >= 10, failed


def test_fuzz_finds_the_wrap_bug_and_shrinks_it(rings, capsys, tmp_path):
    """Bounded by examples (a verdict and a shrink that do not depend on
    the machine's speed): found, and shrunk to the appends that wrap."""
    code = main(["fuzz", "--target", f"exec:{rings['wrap']}", "--examples", "25", "--seed", "5", "--inplace", "on",
                 "--out", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1, report
    run0 = report["runs"][0]
    assert run0["result"] == "FAILED", run0
    trace = load(run0["trace"])
    assert trace.cache["kind"] == "rotating" and trace.cache["rows"] == "portable"
    ops = [op for op in trace.ops if op["op"] != "expect"]
    assert 1 <= len(ops) <= 4 and all(op["op"] == "append" for op in ops), ops  # the ring must wrap: appends only
    assert run(capsys, "replay", run0["trace"], "--target", f"exec:{rings['wrap']}")[0] == 1
    assert run(capsys, "replay", run0["trace"], "--target", f"exec:{rings['good']}")[0] == 0
    assert run(capsys, "replay", run0["trace"])[0] == 0  # and on our ring


#: variant -> (cache, ops, the op index it diverges at, what)
PLANTED = {
    "wrap": ({"max_size": 2}, [{"op": "append", "n": 2}, {"op": "append", "n": 1}], 1, "make_mask(1"),
    "mask_wide": ({"max_size": 3}, [{"op": "append", "n": 3}], 0, "make_mask(3"),
    "no_masks": ({"max_size": 3}, [{"op": "append", "n": 1}], 0, "adapter broke the protocol"),
    "idx": ({"max_size": 2}, [{"op": "append", "n": 2}, {"op": "append", "n": 1}], 1, "idx differs"),
    "capacity": ({"max_size": 2}, [{"op": "append", "n": 1}, {"op": "append", "n": 3}], 1, "capacity differs"),
    "trimmable": ({"max_size": 2}, [{"op": "append", "n": 3}], 0, "trimmable differs"),
    "trimmable_rows": ({"max_size": 2, "undo": 2}, [{"op": "append", "n": 2}, {"op": "append", "n": 1}], 1,
                       "trimmable_rows differs"),
    "log_saved_rows": ({"max_size": 2, "undo": 2}, [{"op": "append", "n": 1}, {"op": "append", "n": 1}], 1,
                       "log_saved_rows differs"),
    "undo_decode": ({"max_size": 2, "undo": 1}, [{"op": "append", "n": 2}, {"op": "append", "n": 1},
                                                 {"op": "trim", "n": 1}], 2, "live window differs"),
}


@pytest.mark.parametrize("variant", sorted(PLANTED))
def test_each_planted_ring_fault_is_a_divergence_at_its_op(rings, variant):
    """Each observable of the ring, the masks and the undo log: a client
    that stops comparing one (or stops asking for the masks) fails here."""
    cache, ops, index, what = PLANTED[variant]
    doc = {"kvtrace": 1, "cache": {"kind": "rotating", "step": 1, "kv_heads": 1, "head_dim": 2, **cache}, "ops": ops}
    trace = loads(json.dumps(doc))
    assert replay(trace, target=resolve(f"exec:{rings['good']}")).ok
    result = replay(trace, target=resolve(f"exec:{rings[variant]}"))
    assert not result.ok and result.divergence.index == index and result.divergence.what.startswith(what), \
        result.divergence


def test_every_ring_observable_has_a_planted_misreport():
    what = {v[3].split(" ")[0] for v in PLANTED.values()}
    assert set(ex.KIND_OBSERVABLES["rotating"]) - {"offset"} <= what, what  # offset: as for dense (test_exec_target)
    assert any(w.startswith("make_mask") for w in what)


# -- versions ---------------------------------------------------------------------


def test_a_kvproto1_adapter_runs_as_before_and_gets_no_kvproto2_field(rings, monkeypatch):
    """The dense reference adapter (kvproto/1) still passes its traces; its
    session is of version 1, its replies are judged by kvproto/1's schema,
    and no request it gets carries a field kvproto/1 does not have."""
    sent: list[dict] = []
    real = ex.Session.request

    def spy(self, body, part="reply"):
        sent.append(body)
        return real(self, body, part)

    monkeypatch.setattr(ex.Session, "request", spy)
    target = resolve(f"exec:{rings['dense']}")
    assert target.version == 1 and "over kvproto/1" in target.description
    for name in ("token_identities.json", "trim_to_zero_keeps_buffers.json"):
        result = replay(load(REPO / "tests" / "traces" / name), target=target)
        assert result.ok, result.divergence
    hellos = [b for b in sent if b["request"] == "hello"]
    assert hellos and all(b["kvproto"] == 1 for b in hellos)
    v1_request = ex.validator("request")
    for body in sent:
        assert "masks" not in body
        if body["request"] != "hello":
            assert v1_request.is_valid({"id": 0, **body}), body
    # a kvproto/1 session never takes a kvproto/2 field in a reply
    assert ex.reply_ok({"id": 1, "ok": True, "state": {"cache": [], "held": None, "holders": {}}})
    assert not ex.reply_ok({"id": 1, "ok": True, "masks": [["1"]], "state": {"cache": [], "held": None, "holders": {}}})


def test_a_kvproto1_session_takes_no_kvproto2_field(rings, capsys):
    """A kvproto/1 adapter whose state carries a field only kvproto/2 has
    (a ring's ``idx``) breaks kvproto/1: its replies are judged by their
    session's version, not by the newest."""
    trace = str(REPO / "tests" / "traces" / "token_identities.json")
    code, out = run(capsys, "replay", trace, "--target", f"exec:{rings['dense_idx']}")
    assert code == 2 and "fails kvproto/1 at state" in out and "'idx'" in out and "Traceback" not in out, out


def test_kvproto1_hello_still_drives_dense_only(rings, capsys):
    trace = str(REPO / "tests" / "traces" / "mask_hides_sinks.json")
    code, out = run(capsys, "replay", trace, "--target", f"exec:{rings['as_v1']}")
    assert code == 2 and "did not answer hello" in out and "kvproto/1" in out and "'rotating'" in out, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("variant,words", [
    ("bad_kind", ["kinds", "'ring'"]),
    ("bad_field", ["fields ['window']", "rotating"]),
    ("bad_op", ["ops ['rewind']", "rotating"]),
    ("bad_observable", ["observables", "'live_len'"]),
])
def test_a_kvproto2_hello_that_is_not_the_kinds_is_exit_2_with_one_line(rings, capsys, variant, words):
    trace = str(REPO / "tests" / "traces" / "mask_hides_sinks.json")
    for argv in (["replay", trace], ["fuzz", "--budget", "1"]):
        code, out = run(capsys, *argv, "--target", f"exec:{rings[variant]}")
        assert code == 2 and "Traceback" not in out, out
        assert len(out.strip().splitlines()) == 1 and all(w in out for w in words), out


# -- the schema -------------------------------------------------------------------


def test_the_schema_takes_the_ring_adapters_messages_and_the_fast_check_agrees(rings):
    """Every hello and reply of a real ring session satisfies the shipped
    schema (``$defs/hello_reply``, ``$defs/reply2``), and the fast check
    agrees with jsonschema on them and on broken copies."""
    s = ex.Session([rings["good"]], 10)
    try:
        hello = s.request(dict(ex.HELLO), "hello_reply")
        assert ex.validator("hello_reply").is_valid(hello) and s.version == 2
        cache = {"kind": "rotating", "max_size": 3, "keep": 1, "step": 2, "undo": 2, "kv_heads": 1, "head_dim": 2,
                 "rows": "portable"}
        replies = [s.request({"request": "init", "cache": cache, "wide": False})]
        first = 0
        for n in (2, 3, 1, 1):
            replies.append(s.request({"request": "op", "op": {"op": "append", "n": n}, "first": first,
                                      "masks": [None, 1, 2]}))
            first += n
        replies.append(s.request({"request": "op", "op": {"op": "trim", "n": 1}}))
        replies.append(s.request({"request": "op", "op": {"op": "trim_to", "len": 0}}))
    finally:
        s.close()
    assert replies[-1]["ok"] is False and replies[-1]["error"]["category"] == "state"
    assert all("masks" in r for r in replies[1:5])
    full = ex.validator("reply2")
    broken = []
    for r in replies:
        assert full.is_valid(r) and ex.reply_ok(r, 2), r
        broken += [{**r, "masks": [["12"]]}, {**r, "extra": 1},
                   {**r, "state": {**r["state"], "trimmable": 1}},
                   {**r, "state": {**r["state"], "idx": "3"}},
                   {**r, "state": {**r["state"], "ring": []}}]
    for b in broken:
        assert ex.reply_ok(b, 2) == full.is_valid(b) is False, b

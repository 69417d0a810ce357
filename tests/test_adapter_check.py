"""``kvspec adapter check`` and ``kvspec adapter new`` (docs/targets.md,
"Checking an adapter", "Starting an adapter").

Each kind of problem an adapter can have produces its own sentence (what
was sent, what came back, the rule, the fix), every problem is reported,
not only the first, and the exit status is 0 clean, 1 problems, 2 bad
usage. The broken adapters are the Python skeleton with one planted change
each (a text substitution the test asserts still applies), so a change of
the skeleton cannot silently disarm them. The skeletons themselves pass
the check and a campaign: the Python one run as written, the C one built
with the system cc, the Rust one with cargo when it is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main
from tests.target_examples import CACHE_MODULE

SKELETON = resources.files("kvspec.fuzz").joinpath("skeletons", "adapter.py").read_text()

#: fault -> (text of the skeleton, its replacement); several pairs per fault allowed
FAULTS: dict[str, list[tuple[str, str]]] = {
    "banner": [("    cache: Cache | None = None\n    for line in sys.stdin:",
                ("    cache: Cache | None = None\n    print('my adapter 0.1 starting', flush=True)\n"
                 "    for line in sys.stdin:"))],
    "garbage_reply": [('        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\\n")',
                       ('        sys.stdout.write("ok\\n" if what == "op" and req["op"]["op"] == "trim" else '
                        'json.dumps(reply, separators=(",", ":")) + "\\n")'))],
    "hang": [('        return cache.trim(op["n"]), False',
              '        __import__("time").sleep(60)\n        return cache.trim(op["n"]), False')],
    "exit": [("    def trim(self, n: int) -> int:\n", "    def trim(self, n: int) -> int:\n        sys.exit(3)\n")],
    "unknown_fields": [('"version": "0.1", "windows": "bytes",', '"version": "0.1", "windows": "bytes", "colour": 1,'),
                       ('"dtype", "rows"]', '"dtype", "rows", "colour"]')],
    "omits_required": [('"version": "0.1", "windows": "bytes",', '"version": "0.1",')],
    "wrong_dtype_width": [('self.width = 4 if self.dtype == "float32" else 2', "self.width = 4")],
    "offset_as_string": [('observables = {"offset": self.offset(),', 'observables = {"offset": str(self.offset()),')],
    "wrong_id": [('reply = {"id": rid, "ok": True, "result": result}', 'reply = {"id": rid + 7, "ok": True, "result": result}')],
    "wrong_category": [('raise Refused("invalid_argument", f"trim_to: len', 'raise Refused("state", f"trim_to: len')],
    "refusal_changes_state": [("        if not 0 <= length <= len(self.rows):\n",
                               "        if not 0 <= length <= len(self.rows):\n            self.rows = self.rows[:-1]\n")],
    "no_exit_on_bye": [("    return 0\n\n\nif __name__", "    import time\n    time.sleep(60)\n    return 0\n\n\nif __name__")],
    "crash_on_unknown_op": [('    raise Refused("unsupported", f"{name}: not an op of this adapter")',
                             '    raise KeyError(name)')],
}


def write_adapter(tmp_path: Path, *faults: str) -> Path:
    text = SKELETON
    for fault in faults:
        for old, new in FAULTS[fault]:
            assert old in text, f"fault {fault}: the skeleton no longer has {old!r}"
            text = text.replace(old, new)
    path = tmp_path / f"adapter_{'_'.join(faults) or 'clean'}.py"
    path.write_text(text)
    return path


#: faults that make the check wait out its hang guard: a short one (the rest
#: answer at once, so a long guard costs nothing and never fires under load)
WAITED = ("hang", "garbage_reply", "no_exit_on_bye")


def check(capsys, *argv: str, timeout: str = "10") -> tuple[int, dict]:
    code = main(["adapter", "check", "--timeout", timeout, "--json", *argv])
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit"] == code
    return code, doc


def problems(doc: dict) -> str:
    return "\n".join(f"{p['step']}: {p['problem']}" for p in doc["problems"])


@pytest.mark.parametrize(("fault", "said"), [
    ("banner", "got a line that is not JSON, 'my adapter 0.1 starting'"),
    ("garbage_reply", "got a line that is not JSON, 'ok'"),
    ("hang", "no reply line came within 2 s (a bounded wait, the hang guard"),
    ("exit", "it exited (exit status 3) without replying"),
    ("unknown_fields", "has field 'colour', which the protocol does not define"),
    ("unknown_fields", "declares cache field 'colour', which a dense cache does not have"),
    ("omits_required", "omits the required field 'windows'"),
    ("wrong_dtype_width", "that is 4 bytes an element: the dtype is float16, 2 bytes an element"),
    ("offset_as_string", "has state/offset = '0', a string, where the protocol wants integer"),
    ("wrong_id", "every reply must carry its request's id"),
    ("wrong_category", "it refused with category 'state'; the contract's category here is 'invalid_argument'"),
    ("refusal_changes_state", "(a refused op changes nothing)"),
    ("no_exit_on_bye", "sent bye and closed stdin; the process was still running 2 s later"),
    ("crash_on_unknown_op", "sent {\"id\": 7, \"request\": \"op\", \"op\": {\"op\": \"no_such_op\"}}; it exited"),
])
def test_each_problem_kind_is_said_in_its_sentence(tmp_path, capsys, fault, said):
    code, doc = check(capsys, sys.executable, str(write_adapter(tmp_path, fault)),
                      timeout="2" if fault in WAITED else "10")
    text = problems(doc)
    assert code == 1 and not doc["ok"], text
    assert said in " ".join(text.split()), text
    if fault in ("banner", "garbage_reply"):  # said once, never also as a hang
        assert "no reply line came" not in text, text
    for p in doc["problems"]:  # one sentence each: what was sent or started, then the rule and a fix
        assert p["problem"].startswith(("sent ", "started ", "the hello ")), p
        assert "\n" not in p["problem"] and "Traceback" not in p["problem"], p


def test_every_problem_is_reported_not_only_the_first(tmp_path, capsys):
    code, doc = check(capsys, sys.executable, str(write_adapter(tmp_path, "omits_required", "wrong_category",
                                                                 "no_exit_on_bye")), timeout="2")
    text = " ".join(problems(doc).split())
    assert code == 1
    for said in ("omits the required field 'windows'", "category 'state'", "still running 2 s later"):
        assert said in text, text


def test_an_adapter_that_does_not_start_is_said_and_exit_1(tmp_path, capsys):
    code, doc = check(capsys, str(tmp_path / "nosuch"))
    assert code == 1 and "it could not start (No such file or directory); build it first" in problems(doc)
    script = tmp_path / "not_executable.py"
    script.write_text("print('hi')\n")
    code, doc = check(capsys, str(script))
    assert code == 1 and "make it executable (chmod +x)" in problems(doc), problems(doc)


def test_a_crash_stops_its_session_only(tmp_path, capsys):
    """An adapter that dies on trim: said once per session that trims, the
    sessions after it still run (each in a fresh process)."""
    code, doc = check(capsys, sys.executable, str(write_adapter(tmp_path, "exit")))
    assert code == 1
    assert any(s.startswith("holders: ") for s in doc["passed"]), doc["passed"]
    assert any("basic session stopped where the adapter did" in n for n in doc["notes"]), doc["notes"]


def test_the_text_report_numbers_the_problems(tmp_path, capsys):
    code = main(["adapter", "check", sys.executable, str(write_adapter(tmp_path, "wrong_category"))])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and "problem 1 (refusals: op trim_to past the offset (refused)): sent" in out, out
    assert "1 problem: fix it and run kvspec adapter check again" in out


@pytest.mark.parametrize("argv", [
    [],                                               # nothing to check
    ["--target", "nosuch_module_x:Cls"],              # a target that names nothing
    ["--target", "usercache.cache:ListCache", "./adapter"],  # both
    ["--timeout", "0", "./adapter"],                  # not a positive number of seconds
    ["--timeout", "nan", "./adapter"],
])
def test_bad_usage_exits_2_with_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exc_info:
        raise SystemExit(main(["adapter", "check", *argv]))
    out = capsys.readouterr()
    text = out.out + out.err
    assert exc_info.value.code == 2 and "Traceback" not in text and text.strip(), text


def test_adapter_new_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert main(["adapter", "new", "--lang", "python", str(tmp_path / "x")]) == 2
    assert "exists and is not an empty folder; nothing was written" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["keep.txt"]
    with pytest.raises(SystemExit) as exc_info:
        main(["adapter", "new", "--lang", "cobol", str(tmp_path / "y")])
    assert exc_info.value.code == 2 and not (tmp_path / "y").exists()


# -- the skeletons ---------------------------------------------------------------


def fuzz_ok(capsys, target: str, out: Path) -> dict:
    try:
        code = main(["fuzz", "--target", target, "--budget", "0.001", "--seed", "1", "--out", str(out), "--json"])
    finally:
        ex.close_sessions()
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and all(r["result"] == "ok" and r["steps"] > 0 for r in report["runs"]), report
    return report


def test_the_python_skeleton_passes_the_check_and_a_campaign(tmp_path, capsys):
    assert main(["adapter", "new", "--lang", "python", str(tmp_path / "py")]) == 0
    out = capsys.readouterr().out
    program = tmp_path / "py" / "adapter.py"
    assert "YOUR CACHE" in program.read_text() and "kvspec adapter check" in out
    code, doc = check(capsys, sys.executable, str(program))
    assert code == 0 and doc["ok"] and len(doc["passed"]) >= 25, problems(doc)
    # no in-place switch: one campaign, not the same one twice
    report = fuzz_ok(capsys, f"exec:{sys.executable} {program}", tmp_path / "out")
    assert [r["config"].rsplit(":", 1)[1] for r in report["runs"]] == ["dense/fp16/inplace"]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no system C compiler (cc)")
def test_the_c_skeleton_compiles_and_passes_the_check_and_a_campaign(tmp_path, capsys):
    assert main(["adapter", "new", "--lang", "c", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "build:  cc -std=c99" in out
    # the C skeleton is the reference adapter itself, named as the user's in its hello
    written = (tmp_path / "c" / "adapter.c").read_text()
    reference = (Path(__file__).resolve().parents[1] / "adapters" / "c" / "kvspec_dense.c").read_text()
    assert written == reference.replace("kvspec-dense-c", "my-dense-cache-c") and written != reference
    exe = tmp_path / "c" / "adapter"
    subprocess.run(["cc", "-std=c99", "-O2", "-Wall", "-Werror", "-o", str(exe), str(tmp_path / "c" / "adapter.c")],
                   check=True, capture_output=True)
    code, doc = check(capsys, str(exe))
    assert code == 0 and doc["ok"], problems(doc)
    fuzz_ok(capsys, f"exec:{exe}", tmp_path / "out")


def test_the_rust_skeleton_builds_with_cargo_and_passes_the_check(tmp_path, capsys):
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: the Rust skeleton is not built here")
    assert main(["adapter", "new", "--lang", "rust", str(tmp_path / "rs")]) == 0
    capsys.readouterr()
    build = subprocess.run(["cargo", "build", "--offline", "--quiet", "--manifest-path", str(tmp_path / "rs" / "Cargo.toml")],
                           check=False, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0 and "warning" not in build.stderr, build.stderr
    code, doc = check(capsys, str(tmp_path / "rs" / "target" / "debug" / "kvspec-adapter"))
    assert code == 0 and doc["ok"], problems(doc)


# -- a cache class ---------------------------------------------------------------


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "checkcache"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cache.py").write_text(CACHE_MODULE + '''

class NoKind:
    def update_and_fetch(self, keys, values):
        return keys, values


class RaisesInInit(ListCache):
    def __init__(self):
        raise RuntimeError("needs a GPU")
''')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "checkcache" or m.startswith("checkcache.")]:
        monkeypatch.delitem(sys.modules, mod)
    return tmp_path


@pytest.mark.parametrize(("cls", "code", "said"), [
    ("ListCache", 0, None),
    ("NegativeTrimCache", 1, 'op 2 {"op": "trim", "n": -1}: return value differs'),
    ("WrongCategoryCache", 1, "refusal category differs"),
    ("NoKind", 1, 'has kvspec_kind = None; a class target declares its kind: add kvspec_kind = "dense"'),
    ("RaisesInInit", 1, "needs a GPU"),
])
def test_a_cache_class_is_checked_by_its_members_and_a_canned_trace(userpkg, capsys, cls, code, said):
    got, doc = check(capsys, "--target", f"checkcache.cache:{cls}")
    assert got == code, problems(doc)
    if said is None:
        assert doc["ok"] and "canned dense trace" in doc["passed"], doc
        assert any("live_start not compared" in n for n in doc["notes"]), doc["notes"]
    else:
        assert said in " ".join(problems(doc).split()), problems(doc)


def test_a_class_in_the_working_folder_is_found_and_sys_path_is_left_as_it_was(tmp_path, monkeypatch, capsys):
    (tmp_path / "herecache.py").write_text(CACHE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "herecache", raising=False)
    before = list(sys.path)
    try:
        code, doc = check(capsys, "--target", "herecache:ListCache")
    finally:
        sys.modules.pop("herecache", None)
    assert code == 0 and doc["ok"], problems(doc)
    assert sys.path == before


@pytest.mark.skipif(shutil.which("cc") is None, reason="no system C compiler (cc)")
@pytest.mark.parametrize(("source", "passed"), [("kvspec_dense.c", 25), ("kvspec_ring.c", 1)])
def test_the_reference_adapters_pass(tmp_path, capsys, source, passed):
    """The dense one (kvproto/1) through every canned session; the ring one
    (kvproto/2, no dense kind) by its hello, with a note that its kind is
    not driven here."""
    exe = tmp_path / source.removesuffix(".c")
    src = Path(__file__).resolve().parents[1] / "adapters" / "c" / source
    subprocess.run(["cc", "-std=c99", "-O2", "-o", str(exe), str(src)], check=True, capture_output=True)
    code, doc = check(capsys, str(exe))
    assert code == 0 and len(doc["passed"]) >= passed, problems(doc)
    if source == "kvspec_ring.c":
        assert doc["passed"] == ["hello"] and any("kinds rotating: only their hello" in n for n in doc["notes"])


def test_a_wrong_state_is_said_once_not_at_every_later_step(tmp_path, capsys):
    """A refused op that drops a row leaves every later state of its session
    off by one: one sentence for the op that did it, none for what follows."""
    code, doc = check(capsys, sys.executable, str(write_adapter(tmp_path, "refusal_changes_state")))
    assert code == 1 and len(doc["problems"]) == 1, problems(doc)
    assert doc["problems"][0]["step"] == "refusals: op trim_to past the offset (refused)", problems(doc)

"""Hugging Face transformers as a second engine (fuzz/adapters/transformers.py,
docs/conformance.md "transformers"): the recorded minimal traces under
tests/traces/conformance/transformers/ (DynamicCache, StaticCache, the
sliding-window layer, QuantizedCache's quanto, HQQ and fp8 layers, each on
its own target) replay against our caches always (exit 0) and against
transformers wherever PyTorch, transformers and the class's backend are
importable (exit 1, at the op and with the divergence the report names); the
summary line of the run says which of the two it did (tests/conftest.py)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.commands.conformance import CONTRACT, FAULT, category
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import load

FOLDER = Path(__file__).parent / "traces" / "conformance" / "transformers"
TRACES = sorted(FOLDER.glob("*_[0-9][0-9].json"))
HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
#: a class's backend beyond PyTorch: target -> (module, package)
BACKENDS = {"transformers-quanto": ("optimum", "optimum-quanto"), "transformers-hqq": ("hqq", "hqq")}
#: what this run did, for the summary line (tests/conftest.py)
DONE: dict[str, int] = {"ours": 0, "transformers": 0}


def _finding(path: Path) -> dict:
    doc = json.loads((FOLDER / "report.json").read_text())
    (f,) = [f for c in doc["classes"] for f in c["findings"] if Path(f["trace"]).name == path.name]
    return f


def test_every_recorded_trace_is_listed_and_classified():
    assert TRACES, "no recorded transformers traces"
    doc = json.loads((FOLDER / "report.json").read_text())
    listed = {Path(f["trace"]).name for c in doc["classes"] for f in c["findings"]}
    assert listed == {p.name for p in TRACES} and doc["ok"] is True
    for c in doc["classes"]:
        for f in c["findings"]:
            assert f["category"] == category(f["what"]) and f["category"] in (FAULT, CONTRACT)


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_passes_on_ours(path, capsys):
    assert main(["replay", str(path)]) == 0
    DONE["ours"] += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_diverges_on_transformers(path):
    if not HAVE_TORCH:
        pytest.skip("PyTorch/transformers not installed (optional extra 'transformers'): "
                    "replayed against our caches only")
    f = _finding(path)
    module, package = BACKENDS.get(f["target"], ("torch", "torch"))
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} not installed ({f['target']}'s backend): replayed against our caches only")
    target = resolve(f["target"])
    for w in f["waived"]:
        target = target.waiving(w)
    result = replay(load(path), target=target)
    assert not result.ok and result.divergence.index == f["index"] and result.divergence.what == f["what"]
    DONE["transformers"] += 1


def test_without_torch_the_target_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["replay", str(TRACES[0]), "--target", "transformers", "--json"]) == 2
    assert "optional extra" in json.loads(capsys.readouterr().out)["error"]

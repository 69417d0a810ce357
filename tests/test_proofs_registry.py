"""Every proof of ``proofs/`` is an obligation of ``kvspec prove``: a module
that proves something (anything but the shared machinery and the
encodings) lists its obligations in ``OBLIGATIONS``, and each is run by
``kvspec.proofs.cli.obligations``, named in ``kvspec.proofs.cli.TITLES`` and costed in
``kvspec.fuzz.commands.verify.PROOF_SECONDS`` (so ``kvspec verify`` runs it as a
job). A proof kept outside the registry (issue 47: the ``nbytes`` proof was
run only by one test) has no negative control checked by ``kvspec prove``,
no units column and no record in docs/proofs.md."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the machinery every obligation shares, and checks run by another command
#: (``equivalents``: ``kvspec verify``'s equivalent-mutant job; ``crosshair_run``:
#: ``kvspec prove --crosshair`` and its own verify jobs)
MACHINERY = {"__init__", "cli", "core", "domain", "traces", "crosshair_run", "equivalents", "dense_controls"}


def proof_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "proofs").glob("*.py")
                  if p.stem not in MACHINERY and not p.stem.endswith("_model"))


def test_every_proof_module_is_an_obligation_of_kvspec_prove() -> None:
    from kvspec.fuzz.commands.verify import PROOF_SECONDS
    from kvspec.proofs.cli import TITLES, obligations

    registered = {n for n, _ in obligations()}
    modules = proof_modules()
    assert "models" in modules and "dense" in modules
    for name in modules:
        module = importlib.import_module(f"kvspec.proofs.{name}")
        numbers = [n for n, _ in getattr(module, "OBLIGATIONS", [])]
        assert numbers, f"proofs/{name}.py proves something but lists no OBLIGATIONS for kvspec prove"
        for n in numbers:
            assert n in registered, f"obligation {n} of proofs/{name}.py is not run by kvspec prove (proofs/cli.py)"
            assert n in TITLES, f"obligation {n} of proofs/{name}.py has no name in kvspec.proofs.cli.TITLES"
            assert n in PROOF_SECONDS, f"obligation {n} of proofs/{name}.py has no expected seconds in PROOF_SECONDS"
    assert sorted(TITLES) == sorted(registered) == sorted(PROOF_SECONDS)

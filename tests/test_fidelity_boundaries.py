"""Every obligation's fidelity test is seen failing on a moved boundary.

A Z3 obligation proves its encoding, not the spec function; the fidelity
tests (tests/test_proofs_fidelity*.py, tests/test_proofs_layers.py,
tests/test_equivalents.py) tie the two by evaluating both on the same
inputs. Such a test is only trusted once seen failing: here, for each
obligation (and each equivalence encoding), one boundary of the spec
function it encodes is moved (``>`` to ``>=``, a bound off by one), the
moved function is swapped into its spec module, and the obligation's
fidelity test must fail. The spec source is read as written (never a
copy), so the case breaks loudly when the rule is rewritten and the
boundary text is gone.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from typing import Any

import pytest
from hypothesis import Phase, settings

# (obligation, spec module, function, boundary as written, moved, fidelity test, its arguments)
CASES: list[tuple[str, str, str, str, str, str, dict[str, Any]]] = [
    ("1 ownership", "kvspec.spec.dense", "inplace_write_allowed", "cache.live_len == cache.marker.live_len",
     "cache.live_len <= cache.marker.live_len", "tests.test_proofs_fidelity:test_inplace_write_allowed", {}),
    ("2 ring", "kvspec.spec.rotating", "ring_slot", "if position < max_size:", "if position <= max_size:",
     "tests.test_proofs_fidelity_rotating:test_ring_slot", {"kind": "int"}),
    ("3 regrow", "kvspec.spec.dense", "regrow_needed", "prev + n > capacity", "prev + n >= capacity",
     "tests.test_proofs_fidelity:test_regrow_capacity_and_needed", {"kind": "int"}),
    ("3 regrow (result)", "kvspec.spec.dense", "regrow_capacity", "-(-n // step) * step", "-(-(n - 1) // step) * step",
     "tests.test_proofs_fidelity:test_regrow_capacity_and_needed", {"kind": "int"}),
    ("4 trim/append", "kvspec.spec.dense", "trim", "n = max(0, min(n, cache.live_len))",
     "n = max(0, min(n, cache.live_len - 1))", "tests.test_proofs_fidelity:test_trim", {"kind": "int"}),
    ("6 paged", "kvspec.spec.paged", "wholly_before", "index < start // block_size", "index <= start // block_size",
     "tests.test_proofs_fidelity_paged:test_index_rules_agree", {}),
    ("7 mask", "kvspec.spec.rotating", "mask_visible", "query - key < window - keep", "query - key <= window - keep",
     "tests.test_proofs_fidelity_rotating:test_mask_visible", {"kind": "int"}),
    ("8 undo", "kvspec.spec.rotating", "log_push", "if undo == 0:", "if undo <= 1:",
     "tests.test_proofs_fidelity_rotating_undo:test_rolled_back_matches_spec_and_controls_match_patched_spec", {}),
    ("9 list trim", "kvspec.spec.layers", "list_trim_count", "if count > exact:", "if count >= exact:",
     "tests.test_proofs_layers:test_encoding_matches_the_spec_rule", {}),
    ("10 turbo trim", "kvspec.spec.turbo", "trim_split", "from_hot = min(n, live_len - cold_offset)",
     "from_hot = min(n, live_len - cold_offset - 1)", "tests.test_proofs_fidelity_turbo:test_counters_match_the_spec",
     {}),
    ("11 fold", "kvspec.spec.turbo", "fold_block_rows", "if hot > hot_threshold", "if hot >= hot_threshold",
     "tests.test_proofs_fidelity_turbo:test_counters_match_the_spec", {}),
    ("11 fold (handoff)", "kvspec.spec.turbo", "handoff_fold", "live_len > 0", "live_len > 1",
     "tests.test_proofs_fidelity_turbo:test_fold_and_trim_transitions_match_the_spec", {}),
    ("12 pack", "kvspec.spec.turbo", "head_dim_allowed", "head_dim % 8 == 0", "head_dim % 4 == 0",
     "tests.test_proofs_fidelity_turbo:test_counters_match_the_spec", {}),
    # (``offset <= max_size`` to ``<``, ``n_old <= budget`` to ``<`` and
    # ``budget > sinks`` to ``>=`` are equivalent mutants: both branches
    # agree on the boundary; the drawn front-trim test alone misses a keep
    # clamp moved by one, the small box sees it)
    ("equivalence visible_at_window", "kvspec.spec.rotating", "visible_positions", "range(offset - (max_size - keep), offset)",
     "range(offset - (max_size - keep) + 1, offset)", "tests.test_equivalents:test_visible_encoding_matches_spec", {}),
    ("equivalence prefill_cut", "kvspec.spec.rotating", "prefill_kept", "range(n_old - (budget - sinks), n_old)",
     "range(n_old - (budget - sinks) + 1, n_old)", "tests.test_equivalents:test_prefill_cut_encoding_matches_spec", {}),
    ("13 batch (announced block)", "kvspec.spec.batch", "announced_block", "if any(p > n for p in pads):",
     "if any(p > n + 1 for p in pads):", "tests.test_batch:test_the_z3_model_is_the_spec", {}),
    ("13 batch (trim)", "kvspec.spec.batch", "trim_count", "return max(0, min(n, *offsets(layout)))",
     "return max(0, min(n, *offsets(layout)) - 1)", "tests.test_batch:test_the_z3_model_is_the_spec", {}),
    ("5 front trim (small box)", "kvspec.spec.dense", "trim_front_keep_sink", "keep = max(0, min(keep, cache.live_len - n))",
     "keep = max(0, min(keep, cache.live_len - n - 1))",
     "tests.test_proofs_fidelity:test_trim_front_keep_sink_small_box", {}),
    ("25 prefix hit cap", "kvspec.spec.prefix", "max_hit_blocks", "(n_tokens - 1) // block_size", "n_tokens // block_size",
     "tests.test_proofs_fidelity_prefix:test_integer_rules_are_the_spec_rules", {"bs": 2}),
    ("22 prefix full block", "kvspec.spec.prefix", "is_full", "index < n_tokens // block_size",
     "index <= n_tokens // block_size", "tests.test_proofs_fidelity_prefix:test_integer_rules_are_the_spec_rules",
     {"bs": 2}),
    ("22-24 prefix hit chain", "kvspec.spec.prefix", "hit_blocks", "for i in range(max_hit_blocks(len(tokens), bs)):",
     "for i in range(max_hit_blocks(len(tokens), bs) + 1):",
     "tests.test_proofs_fidelity_prefix:test_ops_agree_with_the_spec", {}),
    ("22-24 prefix release order", "kvspec.spec.prefix", "_release", "free=tuple(front) + world.free + tuple(back)",
     "free=world.free + tuple(front) + tuple(back)", "tests.test_proofs_fidelity_prefix:test_ops_agree_with_the_spec",
     {}),
]


def moved(module: Any, name: str, old: str, new: str) -> Any:
    """``module.name`` compiled from its source with ``old`` replaced by
    ``new`` (exactly one occurrence), its globals the module's own."""
    fn = getattr(module, name)
    src = textwrap.dedent(inspect.getsource(fn))
    body = ast.parse(src).body[0].body  # type: ignore[attr-defined]
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    lines = src.splitlines(keepends=True)
    cut = body[0].end_lineno if has_doc else 1  # the docstring may state the rule too: move the code only
    head, code = "".join(lines[:cut]), "".join(lines[cut:])
    assert code.count(old) == 1, f"{module.__name__}.{name}: the boundary {old!r} is not written once"
    scope: dict[str, Any] = {}
    exec(compile(head + code.replace(old, new), inspect.getsourcefile(fn) or "<moved>", "exec"),  # noqa: S102
         module.__dict__, scope)
    return scope[name]


def _test(path: str) -> Any:
    mod, fn = path.split(":")
    return getattr(importlib.import_module(mod), fn)


@pytest.mark.parametrize("obligation, mod, name, old, new, test, kwargs", CASES, ids=[c[0] for c in CASES])
def test_a_moved_boundary_fails_the_fidelity_test(monkeypatch, obligation, mod, name, old, new, test, kwargs):
    module = importlib.import_module(mod)
    fidelity = _test(test)  # it passes on the spec as written (it runs in the suite itself)
    monkeypatch.setattr(module, name, moved(module, name, old, new))
    current = getattr(fidelity, "_hypothesis_internal_use_settings", None)
    if current is not None:  # a drawn test: no shrinking, no example database (for this run only)
        quick = settings(current, database=None, phases=(Phase.explicit, Phase.generate))
        monkeypatch.setattr(fidelity, "_hypothesis_internal_use_settings", quick)
    with pytest.raises(Exception) as caught:  # any failure of the fidelity test
        fidelity(**kwargs)
    assert not isinstance(caught.value, (TypeError, NameError, SyntaxError)), caught.value

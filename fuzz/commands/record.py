"""``kvspec record`` (record a tiny model's real decoding, one kvtrace per
layer) and ``kvspec replay --spec-only`` (check recordings against the spec
alone). The recorder and the check are ``kvspec.fuzz.record``; docs/record.md is
the user's page."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the caches a scenario decodes with by name: this project's, or mlx-lm's
#: own; ``MODULE:ATTR`` names any other (:func:`cache_factory`)
CACHES = ("impl", "mlx-lm")


class CacheError(Exception):
    """A ``--cache`` that names nothing usable (exit 2)."""


def cache_factory(spec: str) -> Callable[[Any], list[Any]]:
    """``model -> prompt cache`` for ``--cache``: ``impl``, ``mlx-lm``, or
    ``MODULE:ATTR`` naming a cache class (one instance per layer, built
    with no arguments) or a function ``model -> list of caches``, imported
    with the working directory on ``sys.path`` (as the folder the command
    runs in). Raises CacheError naming the problem."""
    if spec in CACHES:
        return lambda model: _caches(model, spec)
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise CacheError(f"--cache {spec}: impl, mlx-lm or MODULE:ATTR (a cache class or a function model -> caches)")
    import importlib
    import os
    import sys

    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - a module that fails to import (any error) is a bad argument
        raise CacheError(f"--cache {spec}: cannot import it ({type(exc).__name__}: {exc})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if isinstance(obj, type):
        return lambda model: [obj() for _ in model.layers]
    if callable(obj):
        return lambda model: list(obj(model))
    raise CacheError(f"--cache {spec}: names a {type(obj).__name__}, not a cache class or a function")
#: draft tokens a round in the speculative scenario
NUM_DRAFT = 3


def _caches(model: Any, which: Any, num_draft_tokens: int = 0) -> list[Any]:
    if callable(which):
        return which(model)
    if which == "mlx-lm":
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model)
    from kvspec.impl.models import make_prompt_cache as ours

    return ours(model, num_draft_tokens=num_draft_tokens)


def _generate(model: Any, caches: list[Any], prompt: Any, n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=caches)]


def scenario_generate(which: Any, seed: int, tokens: int, out: Path | None) -> Any:
    """Two chat turns on one prompt cache through mlx-lm's ``generate_step``
    (what ``generate``/``stream_generate`` run): a 12-token prompt, then a
    5-token turn, ``tokens`` generated after each."""
    from kvspec.fuzz.commands.e2e.models import tiny_llama, token_ids
    from kvspec.fuzz.record import record

    model = tiny_llama(seed)
    cache = _caches(model, which)
    with record(cache, out) as rec:
        _generate(model, cache, token_ids(seed, 12), tokens)
        _generate(model, cache, token_ids(seed + 1, 5), tokens)
    return rec


def scenario_server(which: Any, seed: int, tokens: int, out: Path | None) -> Any:
    """A server that keeps one prompt cache between requests and its state
    with it: request 1 (a 10-token prompt, ``tokens`` generated) ends with
    ``saved = [c.state for c in cache]``; request 2 shares all but the last
    2 tokens of that conversation, so the server puts the saved state back
    (``c.state = s``), trims the 2 tokens (``trim_prompt_cache``) and
    decodes its own 3 tokens; request 3 starts from the saved state again."""
    from mlx_lm.models.cache import trim_prompt_cache

    from kvspec.fuzz.commands.e2e.models import tiny_llama, token_ids
    from kvspec.fuzz.record import record

    model = tiny_llama(seed)
    cache = _caches(model, which)
    with record(cache, out) as rec:
        _generate(model, cache, token_ids(seed, 10), tokens)
        saved = [c.state for c in cache]
        for prompt in (token_ids(seed + 1, 3), token_ids(seed + 2, 3)):
            for c, s in zip(cache, saved):
                c.state = s
            trim_prompt_cache(cache, 2)
            _generate(model, cache, prompt, tokens)
    return rec


def scenario_speculative(which: Any, seed: int, tokens: int, out: Path | None) -> Any:
    """mlx-lm's ``speculative_generate_step`` with a one-layer early-exit
    draft, ``NUM_DRAFT`` draft tokens a round, ``2 * tokens`` tokens: every
    rejected draft token is a trim of the main model's and the draft's
    caches (layers 0-1: the model's, layer 2: the draft's)."""
    from mlx_lm.generate import speculative_generate_step

    from kvspec.fuzz.commands.e2e.models import (
        LATE_LAYER_SCALE,
        early_exit_draft,
        tiny_llama,
        token_ids,
    )
    from kvspec.fuzz.record import record

    model = tiny_llama(seed, late_scale=LATE_LAYER_SCALE)
    draft = early_exit_draft(model)
    cache = _caches(model, which, NUM_DRAFT) + _caches(draft, which, NUM_DRAFT)
    with record(cache, out) as rec:
        for _ in speculative_generate_step(token_ids(seed, 12), model, draft, num_draft_tokens=NUM_DRAFT,
                                           max_tokens=2 * tokens, prompt_cache=cache):
            pass
    return rec


SCENARIOS: dict[str, Callable[[Any, int, int, Path | None], Any]] = {
    "generate": scenario_generate, "server": scenario_server, "speculative": scenario_speculative,
}


def _out_problem(out: Path) -> str | None:
    """Why the folder ``out`` could not be created (None: it can), checked
    without creating anything: the nearest existing folder above it must be
    a folder this process may write into."""
    import os

    above = out.absolute()
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        return f"{above} is a file"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{above} is not writable"
    return None


def cmd_record(args: argparse.Namespace, console: Any, usage_error: Callable[..., int]) -> int:
    """Exit 0 recorded (what the recording could not show is printed as
    notes), 2 bad arguments (``usage_error(console, message, as_json)``
    prints them)."""
    if args.tokens < 1 or args.tokens > 64:
        return usage_error(console, f"--tokens: between 1 and 64 tokens a turn, got {args.tokens}", args.json)
    if args.seed < 0 or args.seed >= 2**32:
        return usage_error(console, f"--seed: an integer in [0, 2^32), got {args.seed}", args.json)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return usage_error(console, f"--out {args.out}: exists and is not a folder", args.json)
    problem = _out_problem(out)
    if problem:
        return usage_error(console, f"--out {args.out}: cannot create the folder ({problem})", args.json)
    try:
        factory: Any = args.cache if args.cache in CACHES else cache_factory(args.cache)
    except CacheError as exc:
        return usage_error(console, str(exc), args.json)
    start = time.perf_counter()
    try:
        rec = SCENARIOS[args.scenario](factory, args.seed, args.tokens, None)
    except Exception as exc:  # a cache that cannot decode: said in one line, never a traceback
        if args.cache in CACHES:
            raise
        return usage_error(console, f"--cache {args.cache}: decoding with it raised {type(exc).__name__}: {exc}",
                           args.json)
    if not rec.traces():  # no layer was given rows the recorder could take: nothing to write, nothing to check
        return usage_error(console, f"--cache {args.cache}: nothing was recorded ("
                           + "; ".join(rec.notes or ["no layer was given rows"]) + ")", args.json)
    paths = rec.write(out, f"recorded by kvspec record {args.scenario} --cache {args.cache} --seed {args.seed} "
                           f"--tokens {args.tokens}")
    ops = {str(p): len(json.loads(p.read_text())["ops"]) for p in paths}
    if args.json:
        print(json.dumps({"ok": True, "exit": 0, "scenario": args.scenario, "cache": args.cache,
                          "traces": ops, "notes": rec.notes, "seconds": round(time.perf_counter() - start, 3)}))
        return 0
    console.print(f"recorded {args.scenario} on {args.cache}'s caches: {len(paths)} layers, "
                  f"{sum(ops.values())} ops in {out}/", markup=False)
    for p, n in ops.items():
        console.print(f"  {p}: {n} ops", markup=False)
    for note in rec.notes:
        console.print(f"  note: {note}", markup=False)
    console.print(f"check it: kvspec replay --spec-only {out}", markup=False)
    return 0


#: flags of ``kvspec replay`` that drive an implementation: none applies to --spec-only
_NOT_SPEC_ONLY = (("bug", "--bug"), ("isolation_only", "--isolation-only"), ("waive", "--waive"),
                  ("sarif", "--sarif"))


def spec_only_problem(args: argparse.Namespace) -> str | None:
    """The flag given with ``--spec-only`` that does not apply to it, as a
    message (None: none)."""
    if (getattr(args, "target", None) or "impl") != "impl":
        return "--target: --spec-only checks a recording on the spec alone; no target runs"
    for attr, flag in _NOT_SPEC_ONLY:
        if getattr(args, attr, None):
            return f"{flag}: --spec-only checks a recording on the spec alone; {flag} applies to a target's run"
    return None


def _spec_only_one(path: str, console: Any, quiet: bool) -> tuple[int, dict[str, Any]]:
    from rich.markup import escape

    from kvspec.fuzz.record import replay_spec_only
    from kvspec.fuzz.trace import TraceFormatError, load

    try:
        trace = load(path)
        start = time.perf_counter()
        result = replay_spec_only(trace)
        seconds = time.perf_counter() - start
    except TraceFormatError as exc:
        if not quiet:
            console.print(f"[bold red]invalid kvtrace[/] {escape(path)}: {escape(str(exc))}")
        return 2, {"ok": False, "exit": 2, "status": "invalid", "invalid": str(exc), "trace": path}
    except Exception as exc:  # noqa: BLE001 - the harness's own failure: said, never a verdict
        what = f"{type(exc).__name__}: {exc}"
        if not quiet:
            console.print(f"[bold red]tool failure[/] {escape(path)}: the harness raised {escape(what)} "
                          "(not a verdict)")
        return 2, {"ok": False, "exit": 2, "status": "tool failure", "error": what, "trace": path}
    code = 0 if result.ok else 1
    doc = {**result.to_json(), "trace": path, "exit": code, "status": "possible" if result.ok else "impossible",
           "kind": trace.cache["kind"], "seconds": round(seconds, 3)}
    if quiet:
        return code, doc
    if result.ok:
        console.print(f"[green]ok[/] {escape(path)}: {result.ops_run} ops, every one possible under the contract "
                      "(spec only)")
        return code, doc
    console.print(f"[bold red]impossible[/] {escape(path)}: the recording shows what the contract does not allow")
    console.print(escape(str(result)))
    return code, doc


def cmd_replay_spec_only(args: argparse.Namespace, paths: list[str], many: bool, console: Any,
                         usage_error: Callable[..., int]) -> int:
    """``kvspec replay --spec-only``: 0 every op of every recording is
    possible, 1 one is not (the first such op printed), 2 bad input."""
    from kvspec.fuzz.commands.reports import Case, write_junit

    problem = spec_only_problem(args)
    if problem:
        return usage_error(console, problem, args.json)
    results = [_spec_only_one(p, console, quiet=args.json) for p in paths]
    codes = {c for c, _ in results}
    code = 2 if 2 in codes else 1 if 1 in codes else 0
    docs = [d for _, d in results]
    if args.junit_xml:
        cases = []
        for c, doc in results:
            imp = doc.get("impossible")
            detail = (f"op {imp['index']} {json.dumps(imp['op'])}: {imp['what']}\n{json.dumps(imp)}" if imp
                      else doc.get("invalid") or doc.get("error") or f"{doc.get('ops_run', 0)} ops possible")
            cases.append(Case("replay --spec-only", doc["trace"], c == 0, float(doc.get("seconds", 0.0)), detail,
                              error=doc.get("status") == "tool failure"))
        write_junit(args.junit_xml, cases)
    counts = {s: sum(d["status"] == s for d in docs) for s in ("possible", "impossible", "invalid", "tool failure")}
    if args.json:
        print(json.dumps(docs[0] if not many else {"ok": code == 0, "exit": code, "count": len(docs),
                                                   "counts": {k.replace(" ", "_"): v for k, v in counts.items()},
                                                   "traces": docs}))
    elif many:
        console.print(f"{len(docs)} recording{'s' if len(docs) != 1 else ''}: " + ", ".join(
            f"{v} {k}" for k, v in counts.items() if v or k in ("possible", "impossible")), markup=False)
    return code

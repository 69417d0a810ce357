"""The docs' generated parts: tables from the registry, the schema, the
catalog and the commands' records, and pictures drawn by running the spec.

They are written into the pages, so a page read as plain markdown (on a code
host, in an editor) shows what the site shows:

* a region that starts with a line ``<!-- kvspec: table NAME -->`` and ends
  with ``<!-- /kvspec -->`` holds the table :data:`TABLES` ``[NAME]`` draws,
  from the live registry (``fuzz/kinds.py``), the kvtrace schema, the
  injected-bug catalog, the commands' exit codes, the proof obligations'
  record (``docs/generated/obligations.json``, kept current by
  ``tests/test_proofs.py``), the conformance report and the latest benchmark
  record; a new kind, mode, field, op or bug appears by itself, and one
  without a description fails;
* ``<!-- kvspec: picture NAME -->`` regions hold a picture of
  :data:`PICTURES` (its SVG file in ``docs/pictures/``) with its caption: a
  worked-example trace drawn by :mod:`kvspec.fuzz.render` (the spec's state op by
  op), a mask matrix from ``kvspec.spec.rotating.mask_visible``, or the
  layers-by-kinds picture drawn from the registry.

``python -m kvspec.fuzz.docgen write`` (``make docs-tables``) rewrites every region
and picture file that is not current; ``python -m kvspec.fuzz.docgen check`` lists
them (exit 1); ``tests/test_docs.py`` fails on a stale one, naming the file
and the command. A new marker needs no end line: ``write`` adds it.

MkDocs loads this file as a hook module (``mkdocs.yml``: ``hooks``): each
page's regions are filled by the same function (the site never shows a table
twice, nor a stale one); a link to a file of the repository outside
``docs/`` becomes a link to its API reference (``spec/``, ``impl/``) or a
code span naming it, and a link to a path that does not exist fails the
build; Sphinx roles in docstrings (``:class:`X```) become cross-references
(:func:`on_page_content`); ``index.md`` is the README, and ``api/*.md``
list every module of ``spec/`` and ``impl/`` for mkdocstrings.

``python -m kvspec.fuzz.docgen obligations`` rewrites the obligations record from a
run of the proofs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvspec.fuzz import kinds

ROOT = Path(__file__).resolve().parents[1]
OBLIGATIONS_PATH = ROOT / "docs" / "generated" / "obligations.json"
MARKER = re.compile(r"^<!-- kvspec: (table|picture) ([a-z0-9_]+) -->$", re.MULTILINE)
#: the line that closes a generated region
END = "<!-- /kvspec -->"
#: the pictures' SVG files, written beside the pages that show them
PICTURES_DIR = ROOT / "docs" / "pictures"


class DocsError(Exception):
    """A page asks for something the generators do not know, or the registry
    has something the docs do not describe (the build fails)."""


# -- what every op and field means (a new one must be described here) ---------------

OP_TEXT = {
    "append": "`update_and_fetch` of n new rows with the next n identities; n = 1 is a decode step",
    "fetch": "read the live window (paged: of `seq`) without writing",
    "hold": "keep the window the last append returned alive, as a pipelined step does, until the next "
            "`hold` or `release_hold`; it is checked for isolation after every later op",
    "release_hold": "let the held window go",
    "trim": "remove n rows from the end; returns how many went (0 for n <= 0)",
    "trim_to": "trim to `len` rows of offset: `trim(offset - len)`; refused unless `0 <= len <= offset`",
    "trim_front": "`trim_front_keep_sink(n, keep)`: evict n rows after the first `keep`",
    "gather_positions": "keep exactly these rows of the live window, in order",
    "gather_within_tail": "of the last `tail` rows keep those at `kept` (indices into the tail)",
    "snapshot": "prompt-cache snapshot sharing the cache's buffers",
    "restore": "the live cache adopts the snapshot's buffers and window (cells: the snapshot saved as `name` is "
               "written into sequence `seq`, which is cleared first; false when a store lacks room; `drops`, optional: the "
               "window cells the target that ran the trace dropped for it, as at `decode`)",
    "drop": "release a snapshot or a detached handle",
    "state_snapshot": "dense, rotating: mlx-lm's protocol, `saved = c.state` (and `c.meta_state` where the class "
                      "has one), kept uncopied; its rows must never change (semantics.md 8, \"The state protocol\")",
    "state_restore": "dense, rotating: `c.state = saved` (then `c.meta_state`); refuses a plain snapshot, and "
                     "`restore` refuses a state snapshot",
    "detach": "move the cache's tensors into a detached handle; the cache is empty afterwards",
    "install": "install a detached handle into the empty cache (consumes the handle); an `install` of a name whose "
               "handle was consumed hands that very handle in again: refused (StateError), nothing changes",
    "copy": "`copy.deepcopy` (`deep`, default true) or `copy.copy` of the cache, held under `name` like a snapshot "
            "(`restore` from it adopts its window); `live: copy` goes on writing the copy with the original held "
            "(mlx-lm's `LRUPromptCache` deep-copies on every fetch). The snapshot rule: the copy shares the buffers "
            "and owns nothing, so its first write copies (`kvspec.spec.dense.w_copy`, `kvspec.spec.rotating.w_copy`); layers: "
            "a copy of the whole list (`kvspec.impl.layers.copy_prompt_cache`, `kvspec.spec.layers.w_copy`); paged: refused "
            "(UnsupportedOperationError; `fork` is the paged copy, `kvspec.spec.paged.copy_refused`)",
    "append_mismatch": "n rows with one more batch row or kv head, twice the K or V head dim, or another dtype "
                       "for both, for the keys alone (`k_dtype`) or for the values alone (`v_dtype`) "
                       "(`differs`) than the cached rows': refused (InvalidArgumentError, each cache's own words), "
                       "nothing changes; only on a cache holding a buffer (`kvspec.spec.dense.w_append_mismatch`); layers: every "
                       "layer is handed the rows and every layer must refuse them (`kvspec.spec.layers.w_append_mismatch`); paged: "
                       "the pool's rows, once its slabs exist (`kvspec.spec.paged.append_mismatch`)",
    "reload": "save and load the cache (`via`): a prompt-cache file (`kvspec.impl.models`; the loaded layer goes on as the "
              "live cache) or mlx-lm's load order on the cache (`state`, then `meta_state`; not the Turbo classes). "
              "Same window, counters and switch; fresh buffers of the live rows, no marker, a ring's undo log empty "
              "(`kvspec.spec.dense.w_reload`, `kvspec.spec.rotating.w_reload`). A prompt cache (layers) reloads the whole list "
              "(`kvspec.spec.layers.w_reload`); `env`: `KV_INPLACE_WRITE` while the file loads, and every layer keeps the "
              "file's switch; paged (`seq`): through a file refused (UnsupportedOperationError: a file cannot hold a "
              "sequence whose blocks its pool may share), in mlx-lm's order on a sequence that starts at 0 its "
              "rows come back in fresh blocks (`kvspec.spec.paged.reload`, `load_state`)",
    "restore_mixed": "layers: a list restore of snapshot `name` whose list hands layer `layer` (never 0 in the "
                     "machine) the snapshot layer `source` took, of another kind or window: that layer refuses it after "
                     "the layers before it took theirs; refused (InvalidArgumentError, the layer's words), nothing "
                     "changed in any layer, ownership and undo logs included (`kvspec.spec.layers.w_restore_mixed`)",
    "trim_refused_late": "layers: a list trim of n rows in which layer `layer` (never 0 in the machine) refuses its "
                         "own trim after the layers before it trimmed (`how`: its `trim` raises, `short`: trims "
                         "nothing and returns 0, `partial`: really trims, then raises, so the refusing layer "
                         "must be put back too, `fewer` / `more`: trims and returns one row fewer / more than "
                         "asked): refused (StateError) with every layer as it was, ownership and undo "
                         "logs included; 0 with nothing asked when the list's count is 0 "
                         "(`kvspec.spec.layers.w_trim_refused_late`)",
    "handle_trim_to": "physical `trim_to(len)` of a detached handle",
    "fork": "paged: a new sequence `as` sharing every block of `from` (refcounts rise)",
    "release": "paged: drop sequence `seq`; each of its blocks' refcount falls by one",
    "handle_reuse": "paged: the handle (`PagedKVCache`) of sequence `seq` that a release consumed, used again "
                    "(`use`: any public method or property of the handle, `kvspec.spec.paged.HANDLE_REUSES`: `append` a "
                    "row, `fetch`, `trim`, `trim_to`, `trim_front`, `trim_front_keep_sink`, `fork`, `release`, "
                    "`offset`, `live_len`, `size`, `empty`, `nbytes`, `state` / `meta_state` read or assigned "
                    "(`set_state`, `set_meta_state`), `make_mask`; `arg`: the method's arguments, `valid` or ones a live handle "
                    "would refuse, `zero` / `negative`), also after a new sequence took the "
                    "name: refused (StateError, whatever the arguments), nothing changes (`kvspec.spec.paged.handle_reuse`)",
    "state_assign": "paged: `cache.state = (keys, values)` on sequence `seq`'s handle with n new rows (n 0: "
                    "`state = ()`): fresh blocks hold them from position 0, the old blocks released only after; "
                    "refused (StateError: unknown sequence, pool exhausted) with nothing changed, the old blocks "
                    "still the sequence's (`kvspec.spec.paged.state_assign`)",
    "append_pair_mismatch": "n rows as a K/V pair whose values disagree with its keys (`differs`: another "
                            "`dtype`, one more `batch` row or kv head (`kv_heads`), one more row (`rows`)), the keys "
                            "as the cache holds them: refused (InvalidArgumentError, each cache's own words) on any "
                            "cache, empty or not, nothing changes (`kvspec.spec.dense.w_append_pair_mismatch`); layers: "
                            "every layer refuses (`kvspec.spec.layers.w_append_pair_mismatch`); paged: "
                            "`kvspec.spec.paged.append_pair_mismatch`",
    "can_trim": "layers: whether the whole list can trim exactly (`can_trim_prompt_cache`); recurrent: "
                "`is_trimmable()`, the capability (depth > 0)",
    "append_unrecorded": "recurrent: the model's call of the layer with the next n tokens outside the step "
                         "recorder (arrays written, `advance(n)`): the tokens are consumed, the coverage drops to 0 "
                         "(`kvspec.spec.recurrent.step` with `recorded=False`)",
    "layer": "layers: run one op (`do`: `trim_front` or `fetch`) on layer `index` of the list",
    "build_probe": "models: `make_prompt_cache` with these settings (`layout`: a model with `make_cache`, else "
                   "`n_layers` layers): every layer's kind, mode, step, window, sinks, undo depth and Delegated "
                   "settings against `kvspec.spec.models.prompt_cache_layout`; the live list is unchanged",
    "save_load": "models: the list saved with user `metadata` and loaded back: the metadata "
                 "(`kvspec.spec.models.loaded_metadata`), each loaded layer's window, offset and `meta_state`",
    "to_quantized": "models: `to_quantized(group_size, bits)` of `layer` (`bits` absent: 8, `group_size` absent: "
                    "64): the converted cache's mode, group size, bits, offset, live_start, step, capacity, nbytes "
                    "and (dequantized) rows in their dtype, or the refusal (`kvspec.spec.models.to_quantized`)",
    "mask": "models: `make_mask(n, window, return_array=True)` of `layer`, built on the host or (`device`) on "
            "the MLX path CUDA runs, against the kind's spec mask",
    "mechanism": "models: the write layer's in-place mechanism with `KV_CUDA_INPLACE` set to `env` (absent: "
                 "unset) against `kvspec.spec.models.inplace_mechanism`",
    "rows": "models: the portable rows the harness hands in for `tokens` against `kvspec.spec.rows.row_bits`, bit for "
            "bit",
    "expect": "assert the window of the live cache, or of the snapshot, handle or (paged) sequence named by "
              "`of` (paged: `seq` also names the sequence); `order: set` ignores the order; `layer` picks a "
              "layer of a list (default 0); cells: the tokens of sequence `seq` in position order in `store` "
              "(default the first store); prefix: request `req`'s tokens (`window`: a live request's rows, read "
              "through its table, are named by them) and/or its block `table`, or the free queue front to back "
              "(`free`)",
    "decode": "cells: one group of `tokens` at positions `pos0, pos0 + 1, ...`, each held by every sequence of "
              "`seqs` (a shared prompt); returns false when a store has no slot (free plus droppable windowed "
              "cells), refused for bad sequence ids, uncoupled sequences or a position that does not continue; `drops`, "
              "optional: the droppable window cells the target that ran the trace reused (its choice, recorded "
              "by the lockstep), each `[pos, [seq, ...], token]` (the whole cell, held by one sequence out of its "
              "window) or `[[pos, [seq, ...], token], seq]` (`seq` forgets a cell out of its window); the spec and "
              "our cache drop exactly these first (a drop not allowed: exit 2 naming the field); prefix: append "
              "`tokens` to live request `req` (their rows written), blocks popped from the free queue's front as "
              "the tail fills (evicting cached-free ones); returns false, changing nothing, when the free queue is "
              "too short",
    "seq_rm": "cells: remove sequence `seq` (-1: every sequence) from its cells in `[p0, p1)` (`p1` null: to "
              "the end); returns false, changing nothing, when a window store could not honour a partial removal",
    "seq_cp": "cells: share `src`'s cells in `[p0, p1)` with `dst` (no copy); refused if `dst` would hold two "
              "cells at one position",
    "seq_keep": "cells: remove every other sequence; cells `seq` does not hold are freed",
    "seq_add": "cells: move the positions of `seq`'s cells in `[p0, p1)` by `delta` (a shared cell moves for "
               "every holder; below 0: freed); K rows re-rotated before the next read; refused on a collision",
    "seq_div": "cells: positions of `seq`'s cells in `[p0, p1)` floor-divided by `d >= 1`; refused on a collision",
    "pos_min": "cells: the smallest position `seq` holds (the window store's when there is one), -1 if none; "
               "`value`: the expected answer",
    "pos_max": "cells: the largest position `seq` holds (as `pos_min`), -1 if none; `value`: the expected answer",
    "save": "cells: `seq`'s state (llama_state_seq_get_data) kept under `name`: its cells per store, the "
            "window store's live window only, every K row rotated for its position",
    "clear": "cells: free every cell of every store",
    "admit": "prefix: admit request `req` with `tokens` (token ids >= 0) and extra key `salt` (null or an int, "
             "optional): hit the longest chain of cached full-block keys (at most `(len - 1) // B` blocks: the last "
             "token is recomputed), pop the rest from the free queue's front (evicting cached-free blocks), write "
             "the rows past the hit and key every new full block; returns `{\"admitted\", \"hit\", \"table\"}` "
             "(not admitted, nothing changed, when the free queue lacks room) (`kvspec.spec.prefix.admit`)",
    "free": "prefix: release live request `req`'s table tail first (a block reaching refcount 0 joins the free "
            "queue: keyed at the back, cached-free, unkeyed at the front) and forget the request; a double free "
            "is refused (`kvspec.spec.prefix.free`)",
    "preempt": "prefix: as `free`, but the request stays known with its tokens and salt, holding no block "
               "(`kvspec.spec.prefix.preempt`)",
    "resume": "prefix: admit preempted request `req` again with its tokens and salt, as `admit` "
              "(`kvspec.spec.prefix.resume`)",
    "lookup": "prefix: the hit tokens an admit of `tokens` under `salt` would get now; changes nothing "
              "(`kvspec.spec.prefix.lookup`)",
    "free_blocks": "prefix: the block pool's own release of `blocks` by id (vLLM's `BlockPool.free_blocks`): "
                   "every call is refused (a block listed twice, out of range, free already or held by a live "
                   "table), nothing changed: the double-free guard (`kvspec.spec.prefix.free_blocks`)",
    "reset": "prefix: vLLM's `reset_prefix_cache`: false, changing nothing, while any block is held; else every "
             "key dropped, the free queue's order kept (`kvspec.spec.prefix.reset`)",
}

FIELD_TEXT = {
    "kind": "the cache kind",
    "mode": "the storage mode",
    "step": "growth granularity in rows",
    "batch": "B",
    "kv_heads": "H",
    "head_dim": "D, the head dim of keys and values",
    "k_head_dim": "the keys' head dim when it differs from the values' (absent: `head_dim`)",
    "v_head_dim": "the values' head dim when it differs from the keys' (absent: `head_dim`)",
    "dtype": "the dtype rows are handed in (and stored, in the unquantized paths)",
    "inplace": "the in-place switch; `false` is `KV_INPLACE_WRITE=0`",
    "rows": "the row contents: `numpy` (NumPy's seeded draws), `portable` (a closed form any language can "
            "reproduce, `spec/rows.py`) or `ranged` (NumPy draws across the dtype's whole magnitude range: tiny, "
            "huge, negative zeros, mixed scales in a row; the Turbo machine's rows)",
    "inplace_env": "build the cache with `KV_INPLACE_WRITE` set to this spelling (and no `inplace=`); its switch "
                   "must equal `kvspec.spec.dense.inplace_switch(spelling)`",
    "hot_threshold": "Turbo4Delegated: hot V rows kept before a fold (docs/turbo.md)",
    "fold_block": "Turbo4Delegated: rows one block fold moves from hot to cold",
    "max_size": "the window W",
    "keep": "sink rows K, `0 <= keep < max_size`",
    "undo": "undo-log depth U in rows (exact rollback after a wrap)",
    "layers": "the layer pattern of a prompt cache: a list of `{\"kind\": \"dense\", ...}`, "
              "`{\"kind\": \"rotating\", \"max_size\": W, ...}` and `{\"kind\": \"recurrent\", \"kernel\": k, "
              "...}` objects (docs/layers.md)",
    "build": "who builds a prompt cache's layers: `list` (each layer on its own, per-layer `mode`, `step`, `undo`) "
             "or `make_prompt_cache` (`kvspec.impl.models.make_prompt_cache` for a model whose `make_cache()` gives the "
             "layout: the list's mode and step, every ring's undo depth `num_draft_tokens`)",
    "num_draft_tokens": "the `num_draft_tokens` argument of `make_prompt_cache` (every ring's undo depth)",
    "block_size": "rows per pool block",
    "n_blocks": "prefix: the pool's usable blocks (an engine's null block not counted)",
    "max_blocks": "most blocks the pool may grow to (0: no maximum)",
    "chunk": "blocks added per pool growth",
    "size": "recurrent: arrays per layer, 2 (conv window and recurrent state) or 1 (conv window only, lfm2)",
    "kernel": "recurrent: the causal conv's width; the conv window keeps `kernel - 1` input rows (>= 2)",
    "depth": "recurrent: the checkpoint depth U, tokens a rollback may take back (0: none)",
    "channels": "recurrent: C, the conv window's channels (the harness's conv input rows are portable rows of "
                "C values)",
    "n_cells": "cells: cells per store",
    "window": "cells: the window store's window w (a token at p attends to q with p - q < w); `null` without one; "
              "prefix: `null` (full attention; a sliding-window group is not implemented)",
    "stores": "cells: `[\"full\"]`, `[\"full\", \"window\"]` (an iSWA model) or `[\"window\"]`",
    "n_seq": "cells: sequence ids are 0 .. n_seq - 1",
    "window_cells": "cells: cells of the window store, 1 .. n_cells (`\"n_cells\"` or `null`: as many as the full "
                    "store; llama.cpp sizes an iSWA model's window store smaller)",
}

CHECK_TEXT = {
    "returns": "the op's return value (an append's: the window it returned, as identities)",
    "error": "`true`: the spec refuses the op (and so must the implementation); `false`: it succeeds",
    "inplace": "an append's write path: `true` in place, `false` a copying write",
    "capacity": "the cache's capacity (physical rows) after the op",
    "seq": "paged: the sequence the op acts on (default `main`); cells: a sequence id (an integer)",
}


# -- tables ---------------------------------------------------------------------------

def _code(xs: Any) -> str:
    return ", ".join(f"`{x}`" for x in xs) if xs else ""


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    return "\n".join([_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)])


def kinds_table() -> str:
    """One row per registry entry: trace kind, modes, own fields, ops, page."""
    rows = []
    for k in kinds.KINDS.values():
        fields = ", ".join(f"`{f}`" + (" (required)" if v is kinds.REQUIRED else f" = {json.dumps(kinds.field_default(v))}")
                           for f, v in k.fields.items())
        rows.append([f"`{k.name}`", f"`{k.kind}`", _code(k.modes), fields or "—", _code(k.ops) or "—",
                     _code(k.refuses) or "—", f"[{k.files['docs']}]({Path(k.files['docs']).name})"])
    return _table(["entry", "kvtrace kind", "modes", "own cache fields", "own ops", "refuses by contract",
                   "page"], rows)


def _schema() -> dict[str, Any]:
    return json.loads(kinds.SCHEMA_PATH.read_text())


def _values(s: dict[str, Any], defs: dict[str, Any]) -> str:
    while "$ref" in s:
        s = defs[s["$ref"].rsplit("/", 1)[1]]
    if "enum" in s:
        return _code(s["enum"])
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    t = s.get("type", "")
    lo, hi = s.get("minimum"), s.get("maximum")
    if lo is not None or hi is not None:
        return f"{t} {'' if lo is None else lo} to {'' if hi is None else f'{hi:,}'}".strip()
    if t == "array":
        return f"list of {_values(s.get('items', {}), defs) or 'items'}"
    return str(t)


def fields_table() -> str:
    """Every kvtrace cache field: which kinds have it, its values (schema),
    its default (registry), what it means."""
    doc = _schema()
    defs = doc["$defs"]
    props = defs["cache"]["properties"]
    names: dict[str, list[str]] = {}
    for k in kinds.KINDS.values():
        for f in k.cache_fields:
            names.setdefault(f, [])
            if k.name not in names[f]:
                names[f].append(k.name)
    rows = []
    every = set(kinds.KINDS)
    for f, owners in names.items():
        if f not in FIELD_TEXT:
            raise DocsError(f"cache field {f!r} (registry) has no description in fuzz/docgen.py FIELD_TEXT")
        where = "all" if set(owners) == every else ", ".join(owners)
        if f == "kind":
            default = "required"
        elif f in kinds.COMMON_FIELDS:
            default = f"`{json.dumps(kinds.COMMON_FIELDS[f])}`"
        elif f in kinds.OPTIONAL_FIELDS:
            default = "unset"
        else:
            vals = {json.dumps(kinds.field_default(k.fields[f])) if k.fields[f] is not kinds.REQUIRED else "required"
                    for k in kinds.KINDS.values() if f in k.fields}
            default = ", ".join(sorted(v if v == "required" else f"`{v}`" for v in vals))
        if f == "mode":
            values = "; ".join(f"{k.name}: {_code(k.modes)}" for k in kinds.KINDS.values())
        else:
            values = _values(props.get(f, {}), defs) if f in props else ""
        rows.append([f"`{f}`", where, values, default, FIELD_TEXT[f]])
    return _table(["field", "entries", "values", "default", "meaning"], rows)


def _op_rules() -> dict[str, dict[str, Any]]:
    doc = _schema()
    defs = doc["$defs"]
    out: dict[str, dict[str, Any]] = {}
    for entry in defs["op"]["allOf"]:
        if "if" not in entry:
            continue
        cond = entry["if"]["properties"]["op"]
        for n in [cond["const"]] if "const" in cond else cond["enum"]:
            rule = out.setdefault(n, {"required": [], "optional": []})
            then = entry["then"]
            for p in then.get("properties", {}):
                (rule["required"] if p in then.get("required", ()) else rule["optional"]).append(p)
    return out


def ops_table() -> str:
    """Every op some kind runs: its arguments (schema), which entries run it
    and which refuse it by contract (registry), what it does."""
    rules = _op_rules()
    rows = []
    for op in kinds.all_ops():
        if op not in OP_TEXT:
            raise DocsError(f"op {op!r} (registry) has no description in fuzz/docgen.py OP_TEXT")
        r = rules.get(op, {"required": [], "optional": []})
        args = ", ".join([f"`{a}`" for a in r["required"]] + [f"`{a}` (optional)" for a in r["optional"]])
        if op != "release" and "fork" in kinds.all_ops() and "seq" not in r["required"] + r["optional"]:
            args += (", " if args else "") + "`seq` (paged)"
        runs = [k.name for k in kinds.KINDS.values() if op in k.all_ops and op not in k.without]
        refuses = [k.name for k in kinds.KINDS.values() if op in k.refuses]
        rows.append([f"`{op}`", args, ", ".join(runs), ", ".join(refuses) or "—", OP_TEXT[op]])
    return _table(["op", "arguments", "run by", "refused by contract", "what it does"], rows)


def checks_table() -> str:
    """The checks every op may carry (the schema's common op members)."""
    doc = _schema()
    defs = doc["$defs"]
    common = [e for e in defs["op"]["allOf"] if "if" not in e]
    rows = []
    for e in common:
        for name, s in e["properties"].items():
            if name not in CHECK_TEXT:
                raise DocsError(f"op member {name!r} (schema) has no description in fuzz/docgen.py CHECK_TEXT")
            rows.append([f"`{name}`", _values(s, defs), CHECK_TEXT[name]])
    return _table(["member", "values", "checks"], rows)


def exit_codes_table() -> str:
    """Each command's exit statuses, as its ``--help`` prints them."""
    from kvspec.fuzz.commands.cli import EXIT_CODES

    rows = [[f"`kvspec {name}`", text.removeprefix("exit status: ")] for name, text in EXIT_CODES.items()]
    from kvspec.proofs import cli as proofs_cli

    doc = " ".join((proofs_cli.__doc__ or "").split())
    m = re.search(r"Exit status (.*?\.)", doc)
    if m:
        rows.append(["`kvspec prove`", m.group(1)])
    return _table(["command", "exit status"], rows)


def bugs_table() -> str:
    """The injected-bug catalog: every entry, the rule it breaks and where it
    comes from."""
    from kvspec.fuzz.bugs import catalog

    rows = [[f"`{b.name}`", f"{b.kind}/{', '.join(b.modes)}", b.clause, b.source, f"`{b.replaces}`",
             b.description, "GPU only" if b.device == "gpu" else ""] for b in catalog()]
    return _table(["bug", "kind / modes", "rule broken", "comes from", "replaces", "what goes wrong", ""], rows)


def kill_matrix_table() -> str:
    """What ``kvspec mutants`` must catch: every bug in every configuration
    it is fuzzed in (its first mode, every variant)."""
    from kvspec.fuzz.bugs import catalog

    rows = []
    for b in catalog():
        configs = [f"{b.kind}/{b.modes[0]}" + ("" if b.inplace else " inplace off")]
        for label, fields, observed in b.variants:
            configs.append(f"{label}" + ("" if observed else " (in-place decision unobserved)"))
        rows.append([f"`{b.name}`", len(configs), "; ".join(configs)])
    return _table(["bug", "runs", "configurations (each caught from every seed)"], rows)


#: the record of one ``kvspec mutants --seeds 5 --json`` run (its JSON
#: document as printed, under ``report``, with where and how it ran)
MUTANTS_PATH = ROOT / "docs" / "generated" / "mutants.json"


def mutants_record() -> dict[str, Any]:
    if not MUTANTS_PATH.exists():
        raise DocsError(f"{MUTANTS_PATH.relative_to(ROOT)} is missing: python -m kvspec.fuzz.docgen mutants REPORT.json")
    return json.loads(MUTANTS_PATH.read_text())


def catch_rows(record: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The record's rows, each with its kind (from the catalog: a variant's
    row is named ``bug [variant]``), in catalog order."""
    from kvspec.fuzz.bugs import catalog

    record = mutants_record() if record is None else record
    kinds_of = {b.name: b.kind for b in catalog()}
    rows = []
    for m in record["report"]["mutants"]:
        bug = m["name"].split(" [", 1)[0]
        if bug not in kinds_of:
            raise DocsError(f"{MUTANTS_PATH.name}: {bug!r} is no catalog entry (python -m kvspec.fuzz.docgen mutants)")
        rows.append({**m, "kind": kinds_of[bug]})
    return rows


def catch_summary(record: dict[str, Any] | None = None) -> list[list[Any]]:
    """Per kind: rows, the median over its rows of their median seconds and
    examples to catch, and the worst row's median and worst seed."""
    import statistics

    by: dict[str, list[dict[str, Any]]] = {}
    for r in catch_rows(record):
        by.setdefault(r["kind"], []).append(r)
    out = []
    for kind, rows in by.items():
        meds = [r["median_seconds"] for r in rows]
        out.append([kind, len(rows), f"{statistics.median(meds):.2f}", f"{max(meds):.2f}",
                    f"{max(r['worst_seconds'] for r in rows):.2f}",
                    f"{statistics.median(r['median_examples'] for r in rows):g}",
                    max(r["worst_examples"] for r in rows)])
    return out


CATCH_HEAD = ["kind", "rows", "median s (median of rows)", "slowest row's median s", "worst seed s",
              "median examples", "worst examples"]


def catch_times_table() -> str:
    """Seconds and examples to the first failing example, per catalog row,
    grouped by kind, from the committed record of ``kvspec mutants``
    (:data:`MUTANTS_PATH`); a catalog row the record lacks is listed as not
    measured (a bug added since)."""
    from kvspec.fuzz.commands.mutants import entries

    record = mutants_record()
    rows = {r["name"]: r for r in catch_rows(record)}
    out = []
    for kind in dict.fromkeys(e.bug.kind for e in entries()):
        for e in entries():
            if e.bug.kind != kind:
                continue
            name = f"{e.bug.name} [{e.variant}]" if e.variant else e.bug.name
            r = rows.get(name)
            if r is None:
                out.append([kind, f"`{name}`", "not measured", "", "", ""])
                continue
            out.append([kind, f"`{name}`", f"{r['median_seconds']:.2f}", f"{r['worst_seconds']:.2f}",
                        f"{r['median_examples']:g}", r["worst_examples"]])
    head = (f"Record `docs/generated/{MUTANTS_PATH.name}`: `{record['command']}`, {record['when']}, "
            f"{record['machine']}, {record['wall_seconds']:.0f} s wall; {record['report']['seeds']} seeds a row.")
    return head + "\n\n" + _table(["kind", "row", "median s", "worst s", "median examples", "worst examples"], out)


def write_mutants_record(report_path: str, command: str, when: str, machine: str, wall_seconds: float) -> Path:
    """Write :data:`MUTANTS_PATH` from a ``kvspec mutants --json`` document."""
    report = json.loads(Path(report_path).read_text())
    record = {"command": command, "when": when, "machine": machine, "wall_seconds": wall_seconds, "report": report}
    MUTANTS_PATH.write_text(json.dumps(record, indent=1) + "\n")
    return MUTANTS_PATH


def obligations_record() -> dict[str, Any]:
    if not OBLIGATIONS_PATH.exists():
        raise DocsError(f"{OBLIGATIONS_PATH.relative_to(ROOT)} is missing: python -m kvspec.fuzz.docgen obligations")
    return json.loads(OBLIGATIONS_PATH.read_text())


def obligations_table() -> str:
    rows = [[o["number"], o["name"], _code(o["proves"]), o["statement"]] for o in obligations_record()["obligations"]]
    return _table(["#", "obligation", "proves (spec functions)", "states"], rows)


def controls_table() -> str:
    from kvspec.fuzz.bugs import catalog

    bugs = {b.name for b in catalog()}
    rows = [[o["number"], f"`{c['name']}`", c["rule"], f"`{c['name']}`" if c["name"] in bugs else "—"]
            for o in obligations_record()["obligations"] for c in o["controls"]]
    return _table(["obligation", "negative control", "the buggy rule", "catalog bug of that name"], rows)


def conformance_table() -> str:
    """mlx-lm's cache classes: what was fuzzed and found (the committed
    report of ``kvspec conformance``)."""
    from kvspec.fuzz.commands.conformance import CLASSES

    report = json.loads((ROOT / "tests/traces/conformance/report.json").read_text())
    by = {c["cache_class"]: c for c in report["classes"]}
    rows = []
    for cls, target in CLASSES:
        c = by.get(cls.name)
        if c is None:
            raise DocsError(f"conformance class {cls.name} is not in tests/traces/conformance/report.json")
        rows.append([f"`{cls.name}`", target, f"{c['kind']}/{c['mode']}", f"{c['examples']:,}", f"{c['steps']:,}",
                     len(c["findings"]), ", ".join(sorted({f["what"] for f in c["findings"]})) or "—"])
    head = f"mlx-lm {report['mlx_lm']}, seed {report['seed']}, budget {report['budget']:g} s"
    return head + "\n\n" + _table(["class", "target", "kind/mode", "examples", "ops", "findings", "what differs"],
                                  rows)


def bench_records() -> list[Path]:
    """The benchmark records (``docs/benchmarks/*.json``) oldest first: by
    date, then by the number in the name (``gpu8`` before ``gpu11``)."""
    def key(p: Path) -> list[Any]:
        return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", p.stem) if t]
    return sorted((ROOT / "docs/benchmarks").glob("*.json"), key=key)


def bench_table() -> str:
    """The latest benchmark record under docs/benchmarks/ that holds decoder
    rows (an end-to-end-only record, ``DECODER=0``, has none), else the
    latest."""
    records = bench_records()
    if not records:
        raise DocsError("docs/benchmarks/ holds no record (kvspec bench --record docs/benchmarks)")
    docs = [(path, json.loads(path.read_text())) for path in records]
    path, rec = next(((p, d) for p, d in reversed(docs) if d.get("decoder")), docs[-1])
    out = [(f"Record `{path.name}`: {rec.get('gpu') or rec.get('machine')}, mlx {rec.get('mlx')}, "
           f"mlx-lm {rec.get('mlx_lm')}.")]
    cr = rec.get("cache_rows")
    if cr:
        rows = [[r["context"], f"{r['decode_inplace_ms']:.3f}", f"{r['decode_copy_ms']:.3f}",
                 f"{r['rollback_logical_ms']:.3f}", f"{r['rollback_physical_ms']:.3f}"] for r in cr["rows"]]
        out.append(_table(["context", "decode in place (ms)", "decode copying (ms)", "rollback logical (ms)",
                           "rollback physical (ms)"], rows))
    dec = rec.get("decoder")
    if dec:
        ctxs = sorted({c for v in dec["ms_per_step"].values() for c in v}, key=int)
        rows = [[name, *(f"{v.get(c, float('nan')):.3f}" for c in ctxs)] for name, v in dec["ms_per_step"].items()]
        out.append(f"Decoder step, {dec['layers']} layers (ms per step):\n\n" + _table(["row", *ctxs], rows))
    return "\n\n".join(out)


#: every benchmark record (``docs/benchmarks/NAME.json`` and ``.md``), oldest
#: first: the title the site's navigation gives it (mkdocs.yml, under Records)
#: and what it measures; a record without an entry fails the docs
RECORDS: dict[str, tuple[str, str]] = {
    "2026-12-01-gpu-before": ("Decoder and cache rows before the GPU hot-path changes",
                              "the baseline: paged, Int8 and Turbo4 appends growing with the context"),
    "2026-12-01-gpu": ("Decoder and cache rows after the GPU hot-path changes",
                       "no host read on a decode append; rollback rows against their own k-query floor"),
    "2026-12-01-gpu3": ("Decoder rows after the fused window kernels",
                        "Int8 and Turbo4 window dequantization fused, the decode pair's Python calls cut"),
    "2026-12-02-cpu": ("Decoder and cache rows of the write layer",
                       "the write layer on MLX's CPU backend (cache rows flat in the context)"),
    "2026-12-02-gpu": ("Decoder rows after the Fp16 decode host-path cut",
                       "over-floor cost against mlx-lm's caches in one round-robin; first end-to-end rows"),
    "2026-12-02-gpu6": ("Decoder rows with the inline Fp16 append",
                        "every dense and ring row within 1.0 ms of its floor"),
    "2026-12-02-gpu-e2e": ("End to end, three runs a cell",
                           "tokens/s of greedy, speculative and sliding-window decoding, with each cell's range"),
    "2026-12-02-gpu8": ("Decoder and end-to-end rows with the one-pass decode-pair accept",
                        "decoder rows and end-to-end tokens/s on the same code"),
    "2026-12-02-gpu9-e2e": ("End to end, paired, five repeats",
                            "each run divided by mlx-lm's caches' run of the same repeat"),
    "2026-12-02-gpu10-e2e": ("End to end, paired, nine repeats at 1k and 8k",
                             "paired ratios with more repeats: nothing finer than about 10 % resolved"),
    "2026-12-02-gpu11": ("Decoder rows after the host-path cut",
                         "0.05-0.17 ms a step above mlx-lm's caches; the ring's steady state at or below"),
    "2026-12-02-gpu11-e2e": ("End to end after the host-path cut", "paired ratios, five repeats"),
    "2026-12-02-gpu12-e2e": ("End to end after the backend-cache fix", "paired ratios, five repeats"),
    "2026-12-06-cpu-recurrent-rollback": ("Recurrent layers' rollback",
                                          ("a speculative round of hybrid models with the step recorder on and "
                                          "off, each rollback, the checkpoint ring's memory")),
    "2026-12-06-gpu-recurrent-rollback": ("Recurrent layers' rollback at full size",
                                          ("the same rows at full size in bfloat16: the recorder's price "
                                          "on a verify block")),
    "2026-12-06-gpu13-e2e": ("End to end in interleaved blocks",
                             "blocks of 16 tokens decoded in turn, median ratio with a 95 % interval"),
    "2026-12-06-gpu14-e2e": ("End to end after the decode host-time cut",
                             "greedy and sliding-window decoding level with mlx-lm's caches"),
}


def record_nav_title(stem: str) -> str:
    """A record's title in the site's navigation (mkdocs.yml, under
    Records): what it measures, then the machine and the date."""
    rec = json.loads((ROOT / "docs" / "benchmarks" / f"{stem}.json").read_text())
    gpu = rec.get("gpu") or ""
    machine = next((m for m in ("H200", "H100") if m in gpu), gpu or "CPU")
    return f"{RECORDS[stem][0]} ({machine}, {rec.get('date', stem[:10])})"


def _record_parts(rec: dict[str, Any]) -> str:
    parts = []
    if rec.get("bench") == "recurrent":
        parts.append("recurrent rollback")
    if rec.get("decoder"):
        parts.append(f"decoder step ({rec['decoder']['layers']} layers)")
    if rec.get("cache_rows"):
        parts.append("cache rows")
    e2e = rec.get("e2e")
    if e2e and rec.get("bench") != "recurrent":
        parts.append("end to end" + (", paired" if e2e.get("paired") else ""))
    return ", ".join(parts)


def records_table() -> str:
    """Every benchmark record: what it measures, its date, machine and parts,
    a link to its page (:data:`RECORDS`)."""
    found = {p.stem: p for p in bench_records()}
    for stem in found:
        if stem not in RECORDS:
            raise DocsError(f"benchmark record docs/benchmarks/{stem}.json has no entry in fuzz/docgen.py RECORDS")
    rows = []
    for stem, (title, measures) in RECORDS.items():
        if stem not in found:
            raise DocsError(f"fuzz/docgen.py RECORDS names {stem}, which docs/benchmarks/ does not hold")
        rec = json.loads(found[stem].read_text())
        machine = rec.get("gpu") or f"CPU ({rec.get('machine')})"
        rows.append([f"[{title}](benchmarks/{stem}.md)", measures, rec.get("date", stem[:10]), machine,
                     f"{_record_parts(rec)}; MLX {rec.get('mlx')}, mlx-lm {rec.get('mlx_lm')}"])
    return _table(["record", "what it measures", "date", "machine", "rows; versions"], rows)


TABLES = {
    "records": records_table,
    "kinds": kinds_table, "fields": fields_table, "ops": ops_table, "checks": checks_table,
    "exit_codes": exit_codes_table, "bugs": bugs_table, "kill_matrix": kill_matrix_table,
    "obligations": obligations_table, "controls": controls_table, "conformance": conformance_table,
    "bench": bench_table, "catch_times": catch_times_table,
}


# -- pictures ------------------------------------------------------------------------

#: name -> (worked-example trace, injected bug or None, caption)
PICTURES: dict[str, tuple[str, str | None, str]] = {
    "dense_trim_regrow": ("tests/traces/worked_dense_trim_regrow.json", None,
                          ("A dense cache: a logical trim keeps the capacity (dead tail hatched), the marker moves "
                          "with the cache's own writes, an append after the trim regrows from the live rows.")),
    "dense_snapshot_sharing": ("tests/traces/dense_inplace_beside_snapshot.json", None,
                               "Snapshots share the buffer; decode rows go in place above every holder's rows."),
    "ring_wrap": ("tests/traces/rotating_worked_example.json", None,
                  ("A ring (W 4, one sink): warm-up in place, a snapshot of the full ring, the wrap (steady-state "
                  "writes copy), a multi-row append after the wrap.")),
    "ring_undo_rollback": ("tests/traces/worked_ring_undo_rollback.json", None,
                           ("A ring with an undo log (U 3): decodes past the wrap save the rows they overwrite; a "
                           "trim after the wrap rolls back exactly.")),
    "paged_fork_cow": ("tests/traces/worked_paged_fork_cow.json", None,
                       ("A block table: a fork shares every block (refcount 2), a write into a shared block copies "
                       "it first, a release lowers the refcounts.")),
    "delegated_fold": ("tests/traces/worked_delegated_fold.json", None,
                       ("Turbo4Delegated: hot V rows fold into the cold part block by block; a trim across the fold "
                       "takes hot rows first, then cold.")),
    "list_trim_refused": ("tests/traces/worked_list_trim_refused.json", None,
                          ("A prompt cache of a dense layer and a ring: once the ring has wrapped, the list trim "
                          "refuses for every layer (returns 0).")),
    "steady_state_bug": ("tests/traces/steady_state_inplace.json", "steady_state_inplace",
                         ("A counterexample: the injected bug steady_state_inplace writes in place once the ring is "
                         "full; the divergent op is outlined with the rule it breaks.")),
}
#: name -> (window, keep, keys before the chunk, chunk length): masks drawn from kvspec.spec.rotating.mask_visible
MASKS = {"mask_sinks": (4, 1, 5, 3)}
SPECIAL = ("architecture",)
#: the pages each picture must appear on (tests/test_docs.py): its kind's
#: page and the contract, the counterexample on the review pages
PICTURE_PAGES = {
    "dense_trim_regrow": ("dense.md", "semantics.md"), "dense_snapshot_sharing": ("dense.md",),
    "ring_wrap": ("rotating.md", "semantics.md"), "ring_undo_rollback": ("rotating.md", "semantics.md"),
    "mask_sinks": ("rotating.md", "semantics.md"), "paged_fork_cow": ("paged.md", "semantics.md"),
    "delegated_fold": ("turbo.md", "semantics.md"), "list_trim_refused": ("layers.md", "semantics.md"),
    "steady_state_bug": ("render.md", "review.md"), "architecture": ("architecture.md",),
}


def picture_names() -> list[str]:
    return [*PICTURES, *MASKS, *SPECIAL]


def picture(name: str) -> str:
    """The SVG text of picture ``name``."""
    if name in PICTURES:
        from kvspec.fuzz.bugs import by_name
        from kvspec.fuzz.render import svg, timeline
        from kvspec.fuzz.trace import load

        path, bug, _ = PICTURES[name]
        factories = by_name(bug).factories if bug else None
        tl = timeline(load(ROOT / path), factories, bug)
        if bug is None and tl.divergence is not None:
            raise DocsError(f"picture {name}: {path} diverges on the implementation: {tl.divergence}")
        return svg(tl)
    if name in MASKS:
        return mask_svg(*MASKS[name])
    if name == "architecture":
        return architecture_svg()
    raise DocsError(f"no picture named {name!r}; known: {', '.join(picture_names())}")


def caption(name: str) -> str:
    if name in PICTURES:
        return PICTURES[name][2]
    if name in MASKS:
        w, k, before, n = MASKS[name]
        return (f"make_mask for a chunk of {n} queries after {before} rows in a ring of W {w} with {k} sink: "
                "query q sees key p iff p <= q and (p < keep or q - p < W - keep) (kvspec.spec.rotating.mask_visible).")
    return ("Layers by kinds, drawn from the registry (fuzz/kinds.py): every entry's file in every layer; a "
            "missing file is dashed.")


def mask_svg(window: int, keep: int, before: int, n: int) -> str:
    """The visibility matrix of a chunk of ``n`` queries after ``before``
    rows: rows are queries, columns keys by absolute position, filled where
    ``kvspec.spec.rotating.mask_visible`` says the query sees the key."""
    from kvspec.spec.rotating import mask_visible

    keys = before + n
    c, left, top = 22, 70, 40
    w, h = left + keys * c + 20, top + n * c + 40
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" class="kvr-mask" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" role="img"><title>mask W {window} K {keep}</title>'),
           f'<rect width="{w}" height="{h}" fill="#fff"/>',
           '<style>text{font-family:ui-monospace,monospace;font-size:10px;fill:#222}</style>']
    for p in range(keys):
        out.append(f'<text x="{left + p * c + 6}" y="{top - 8}">{p}</text>')
    out.append(f'<text x="{left}" y="14">keys (absolute position); sinks outlined</text>')
    for i in range(n):
        q = before + i
        out.append(f'<text x="8" y="{top + i * c + 14}">query {q}</text>')
        for p in range(keys):
            seen = mask_visible(q, p, window, keep)
            fill = "#4a8" if seen else "#f4f4f4"
            stroke = ' stroke="#000" stroke-width="2"' if p < keep else ' stroke="#ccc"'
            out.append(f'<rect class="{"seen" if seen else "hidden"}" x="{left + p * c}" y="{top + i * c}" '
                       f'width="{c - 2}" height="{c - 2}" fill="{fill}"{stroke}/>')
    out.append(f'<text x="{left}" y="{h - 12}">each query sees min(q + 1, W) = {window} keys</text></svg>')
    return "\n".join(out)


def architecture_svg() -> str:
    """Layers (rows) by registry entries (columns): every file of every kind,
    drawn from :attr:`kvspec.fuzz.kinds.Kind.files`; a file that does not exist is
    dashed, so a new kind appears as a new column by itself."""
    layers = ["docs", "bugs", "harness", "impl", "proofs", "proof model", "spec"]
    entries = list(kinds.KINDS.values())
    cw, rh, left, top = 170, 34, 110, 54
    w = left + cw * len(entries) + 20
    h = top + rh * (len(layers) + 1) + 50
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" class="kvr-arch" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" role="img"><title>layers by kinds</title>'),
           f'<rect width="{w}" height="{h}" fill="#fff"/>',
           '<style>text{font-family:ui-monospace,monospace;font-size:11px;fill:#222}.k{font-weight:bold}</style>']
    for j, k in enumerate(entries):
        x = left + j * cw
        out.append(f'<text class="k" x="{x + 6}" y="{top - 24}">{k.name}</text>')
        out.append(f'<text x="{x + 6}" y="{top - 10}">{", ".join(k.modes)[:26]}</text>')
    rows = layers[:3] + ["registry"] + layers[3:]
    for i, layer in enumerate(rows):
        y = top + i * rh
        out.append(f'<text x="8" y="{y + 20}">{layer}</text>')
        if layer == "registry":
            out.append(f'<rect x="{left}" y="{y + 3}" width="{cw * len(entries) - 6}" height="{rh - 6}" '
                       'fill="#fdf3d0" stroke="#b90"/>')
            out.append(f'<text x="{left + 8}" y="{y + 21}">fuzz/kinds.py: one Kind entry per column '
                       f'({len(entries)} entries)</text>')
            continue
        for j, k in enumerate(entries):
            path = k.files[layer]
            x = left + j * cw
            there = (ROOT / path).exists()
            style = 'fill="#e3f1e3" stroke="#393"' if there else 'fill="#fff" stroke="#999" stroke-dasharray="4 3"'
            out.append(f'<g class="file" data-exists="{str(there).lower()}"><rect x="{x}" y="{y + 3}" '
                       f'width="{cw - 6}" height="{rh - 6}" rx="3" {style}/>'
                       f'<text x="{x + 6}" y="{y + 21}">{path}</text></g>')
    y = top + len(rows) * rh + 16
    out.append(f'<text x="8" y="{y}">imports point down: fuzz over impl and proofs, both over spec '
               '(import-linter contracts in pyproject.toml)</text></svg>')
    return "\n".join(out)


# -- generated parts written into the pages ----------------------------------------------

def _block(what: str, name: str, page: str) -> str:
    """What a marker's region holds: the table, or the picture (its SVG file
    under ``docs/pictures/``, linked relative to ``page``) with its caption."""
    if what == "table":
        if name not in TABLES:
            raise DocsError(f"{page}: no table named {name!r}; known: {', '.join(TABLES)}")
        return TABLES[name]()
    if name not in picture_names():
        raise DocsError(f"{page}: no picture named {name!r}; known: {', '.join(picture_names())}")
    prefix = "../" * page.count("/")
    return (f'<figure class="kvspec-picture" markdown="1">\n\n'
            f"![{name}]({prefix}pictures/{name}.svg)\n\n"
            f"<figcaption>{caption(name)}</figcaption>\n</figure>")


def expand(markdown: str, page: str = "") -> str:
    """``markdown`` with every region filled with what its marker asks for
    now: the lines between ``<!-- kvspec: table NAME -->`` (or ``picture
    NAME``) and the next ``<!-- /kvspec -->`` are replaced; a marker without
    its end line gets one. The same text is written into the pages
    (:func:`write_pages`) and served by the site, so a page read as plain
    markdown shows what the site shows; a second pass changes nothing."""
    lines = markdown.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == END or MARKER.match(lines[j])), None)
        out += [lines[i], "", _block(m.group(1), m.group(2), page), "", END]
        i = end + 1 if end is not None and lines[end] == END else i + 1
    return "\n".join(out)


#: the command that rewrites every generated part (named by the staleness test)
WRITE_COMMAND = "python -m kvspec.fuzz.docgen write"


def pages() -> list[Path]:
    """The markdown files that hold generated regions."""
    return sorted(p for p in (ROOT / "docs").rglob("*.md")
                  if "generated" not in p.relative_to(ROOT / "docs").parts and MARKER.search(p.read_text()))


def generated_files() -> dict[Path, str]:
    """Every file the generators own, with the text it must hold now: the
    pages with their regions filled and the pictures' SVG files."""
    out = {p: expand(p.read_text(), p.relative_to(ROOT / "docs").as_posix()) for p in pages()}
    for name in picture_names():
        out[PICTURES_DIR / f"{name}.svg"] = picture(name) + "\n"
    return out


def stale() -> list[Path]:
    """The generated files whose text is not what the generators give now."""
    return [p for p, text in generated_files().items() if not p.exists() or p.read_text() != text]


def write_pages() -> list[Path]:
    """Rewrite every stale generated file; returns those written."""
    written = []
    for p, text in generated_files().items():
        if not p.exists() or p.read_text() != text:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            written.append(p)
    return written


# -- MkDocs hooks -----------------------------------------------------------------------

LINK = re.compile(r"\]\(((?:\.\./)+)([^)#\s]+)(#[^)\s]*)?\)")


def rewrite_links(markdown: str, page: str) -> str:
    """Links from a page to repository files outside ``docs/``: a module of
    ``spec/`` or ``impl/`` links to its API reference; any other existing
    file becomes a code span; a path that does not exist raises DocsError."""
    depth = page.count("/")

    def sub(m: re.Match[str]) -> str:
        ups, path = m.group(1), m.group(2)
        base = (ROOT / "docs" / Path(page).parent / ups / path).resolve()
        if not base.exists():
            raise DocsError(f"{page}: link to {ups}{path}: no such file in the repository")
        rel = base.relative_to(ROOT).as_posix()
        prefix = "../" * depth
        if rel.endswith(".py") and rel.split("/")[0] in ("spec", "impl") and not rel.endswith("__init__.py"):
            module = "kvspec." + rel[:-3].replace("/", ".")
            return f"]({prefix}api/{rel.split('/')[0]}.md#{module})"
        return f"]({prefix}source.md#{_anchor(rel)})"

    return LINK.sub(sub, markdown)


def _anchor(rel: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", rel.lower()).strip("-")


def source_files() -> list[str]:
    """Repository files outside docs/ that pages link to (the source index)."""
    found: set[str] = set()
    for md in (ROOT / "docs").rglob("*.md"):
        page = md.relative_to(ROOT / "docs").as_posix()
        for m in LINK.finditer(md.read_text()):
            base = (ROOT / "docs" / Path(page).parent / m.group(1) / m.group(2)).resolve()
            if base.exists() and base.is_relative_to(ROOT):
                found.add(base.relative_to(ROOT).as_posix())
    return sorted(found)


def source_page() -> str:
    """A page listing the repository files pages cite, each with its module
    docstring's first paragraph: what a link to a file outside the docs
    leads to."""
    out = ["# Source files cited by these pages", "",
           ("The pages link here for files outside `docs/`; `spec/` and `impl/` modules link to the "
           "[API reference](api/spec.md) instead."), ""]
    for rel in source_files():
        path = ROOT / rel
        out.append(f'## `{rel}` {{#{_anchor(rel)}}}')
        out.append("")
        text = ""
        if path.is_file() and path.suffix == ".py":
            import ast

            text = ast.get_docstring(ast.parse(path.read_text())) or ""
        elif path.is_file() and path.suffix == ".json":
            try:
                doc = json.loads(path.read_text())
                text = doc.get("title") or doc.get("description") or ""
            except (ValueError, AttributeError):
                text = ""
        elif path.is_dir():
            text = f"a folder of {len(list(path.iterdir()))} files"
        para = text.strip().split("\n\n")[0] if text else ""
        out.append(para.replace("\n", " ") or "(no description)")
        out.append("")
    return "\n".join(out)


def api_page(package: str) -> str:
    titles = {"spec": "The executable spec (`spec/`)", "impl": "The MLX caches (`impl/`)"}
    out = [f"# {titles[package]}", "",
           "Generated by mkdocstrings from the docstrings; every module of the package is listed.", ""]
    for path in sorted((ROOT / package).glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = f"kvspec.{package}.{path.stem}"
        out += [f"## `{module}` {{#{module}}}", "", f"::: {module}", "    options:", "      show_root_heading: false",
                "      heading_level: 3", ""]
    return "\n".join(out)


def index_page() -> str:
    """The README as the site's front page (its ``docs/x.md`` names become links)."""
    text = (ROOT / "README.md").read_text()
    return re.sub(r"`docs/([a-z0-9_-]+)\.md`", r"[`docs/\1.md`](\1.md)", text)


def api_source() -> Path:
    """The folder the API reference reads the packages from: mkdocstrings finds
    a module by its folders, and the import packages ``kvspec.spec`` and
    ``kvspec.impl`` are the folders ``spec/`` and ``impl/`` (pyproject.toml maps
    them), so ``docs-artifacts/api-src/kvspec/`` holds a link to each."""
    where = ROOT / "docs-artifacts" / "api-src"
    (where / "kvspec").mkdir(parents=True, exist_ok=True)
    for folder in ("spec", "impl", "proofs", "fuzz"):
        link = where / "kvspec" / folder
        if not link.is_symlink() or link.resolve() != ROOT / folder:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path("..", "..", "..", folder), target_is_directory=True)
    return where


def on_config(config: Any) -> Any:  # pragma: no cover - run by MkDocs
    api_source()
    return config


on_config.mkdocs_priority = 100  # type: ignore[attr-defined]  # before mkdocstrings reads its paths


def on_files(files: Any, config: Any) -> Any:  # pragma: no cover - run by MkDocs
    from mkdocs.structure.files import File

    generated = {"index.md": index_page(), "api/spec.md": api_page("spec"), "api/impl.md": api_page("impl"),
                 "source.md": source_page()}
    for name in picture_names():
        generated[f"pictures/{name}.svg"] = picture(name)
    for path, content in generated.items():
        old = files.get_file_from_path(path)
        if old is not None:
            files.remove(old)
        files.append(File.generated(config, path, content=content))
    return files


#: a Sphinx role in a docstring as mkdocstrings renders it (``:class:`X``` -> ``:class:<code>X</code>``)
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const|ref):<code>([^<]*)</code>")
_HEADING_OR_ROLE = re.compile(r'<h[1-6] id="(?P<id>[^"]+)"|' + ROLE.pattern)


def render_roles(html: str) -> str:
    """Sphinx roles left raw in a rendered page (``:func:<code>resume</code>``)
    become cross-references: the name is looked up in the scope of the object
    whose docstring holds it (its own members, then its class's, its
    module's, its package's), then as a full path; ``~a.b.C`` shows as ``C``.
    The reference is optional: a name the reference does not document (a
    private helper, another package) stays a code span, never a dead link."""
    ids = set(re.findall(r'<h[1-6] id="([^"]+)"', html))
    scope = ""

    def sub(m: re.Match[str]) -> str:
        nonlocal scope
        if m.group("id") is not None:
            scope = m.group("id") if "." in m.group("id") or m.group("id") in ("spec", "impl") else scope
            return m.group(0)
        text = m.group(2)
        target = text.lstrip("~.").removesuffix("()")
        title = target.rsplit(".", 1)[-1] if text.startswith("~") else text.lstrip(".")
        parts = scope.split(".") if scope else []
        candidates = [".".join([*parts[:i], target]) for i in range(len(parts), 0, -1)] + [target]
        ident = next((c for c in candidates if c in ids), target)
        return f'<autoref identifier="{ident}" optional><code>{title}</code></autoref>'

    return _HEADING_OR_ROLE.sub(sub, html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:  # pragma: no cover - run by MkDocs
    return render_roles(html)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:  # pragma: no cover
    name = page.file.src_uri
    try:
        return rewrite_links(expand(markdown, name), name)
    except DocsError as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(exc)) from None


# -- the obligations record ---------------------------------------------------------------

def obligations_from(results: list[Any]) -> dict[str, Any]:
    """What the docs show of ``kvspec prove``'s obligations: numbers, names,
    the spec functions, statements and negative controls. No status or
    timing: a solver timeout on a loaded machine must not make the record
    drift (tests/test_proofs.py requires every obligation proved and every
    control refuted)."""
    return {"obligations": [
        {"number": r.number, "name": r.name, "proves": list(r.proves), "statement": r.statement,
         "controls": [{"name": c.name, "rule": c.rule} for c in r.controls]}
        for r in results]}


def write_obligations(results: list[Any]) -> Path:
    OBLIGATIONS_PATH.parent.mkdir(parents=True, exist_ok=True)
    OBLIGATIONS_PATH.write_text(json.dumps(obligations_from(results), indent=1) + "\n")
    return OBLIGATIONS_PATH


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    import sys

    if sys.argv[1:] in (["write"], ["check"]):
        # write: fill every generated region of the pages and every picture file;
        # check: list the stale ones (exit 1), changing nothing
        try:
            todo = write_pages() if sys.argv[1] == "write" else stale()
        except DocsError as exc:
            print(f"docgen: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        for p in todo:
            print(("wrote " if sys.argv[1] == "write" else "stale: ") + p.relative_to(ROOT).as_posix())
        if sys.argv[1] == "check" and todo:
            print(f"run: {WRITE_COMMAND}", file=sys.stderr)
            raise SystemExit(1)
    elif sys.argv[1:] == ["obligations"]:
        from kvspec.proofs.cli import run_all

        print(f"wrote {write_obligations(run_all())}")
    elif sys.argv[1:2] == ["mutants"] and len(sys.argv) == 7:
        # python -m kvspec.fuzz.docgen mutants REPORT.json COMMAND WHEN MACHINE WALL_SECONDS
        report_path, command, when, machine, wall = sys.argv[2:7]
        print(f"wrote {write_mutants_record(report_path, command, when, machine, float(wall))}")
    else:
        print("usage: python -m kvspec.fuzz.docgen write | check\n"
              "       python -m kvspec.fuzz.docgen obligations\n"
              "       python -m kvspec.fuzz.docgen mutants REPORT.json COMMAND WHEN MACHINE WALL_SECONDS", file=sys.stderr)
        raise SystemExit(2)

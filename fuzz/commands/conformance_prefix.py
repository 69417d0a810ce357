"""``kvspec conformance --target vllm``: vLLM's KV-cache manager (the
``prefix`` kind) fuzzed against ``kvspec.spec.prefix``, every divergence class with
a minimal trace.

One class, ``KVCacheManager`` (one full-attention group, prefix caching
on: ``kvspec.fuzz.adapters.vllm``), searched in rounds, as the llama.cpp classes
are (``kvspec.fuzz.commands.conformance_cells``):

* a round runs seeded examples. Each draws a pool (block size 1 to 4, 4 to
  12 blocks) and 2 or 3 base prompts over a vocabulary of 4 tokens that
  share a root (one sometimes a prefix of another, lengths often whole
  blocks), then up to ``steps`` ops drawn from the spec's state: admits of
  a base prompt, a prefix of one or one a token longer (salted now and
  then), decodes of 1 or 2 tokens (often a prompt's own continuation, so
  two requests key the same blocks), frees, preempts and resumes, lookups,
  resets, the pool's own release (``free_blocks``: a held block twice, a
  held block, a free block, an id out of range, no block), and short
  sequences that reach the rare edges (a prompt admitted twice, a prompt
  freed and hit again from the free queue, admits and decodes until the
  pool is exhausted, everything released and reset, a salted admit of a
  cached prompt), with at most 3 requests live. Every op runs on the spec
  and on vLLM in lockstep (``kvspec.fuzz.adapters.vllm.VllmLockstep``: results,
  refusals, every request's table, every block's refcount and key, the free
  queue, the cached map, the rows);
* the first divergence is shrunk (ops removed one at a time, op 0
  included, token lists halved and cut by one, until none keeps the same
  divergence: the same rule, at the same kind of op, charged to an op of
  the same class; so the trace is 1-minimal) to a trace whose ops the spec
  refuses carry ``"error": true``, written as ``KVCacheManager_NN.json``
  and replayed on vLLM (exit 1 expected), on vLLM in paranoid mode (the
  view read through other paths and the adapter's bookkeeping checked: the
  same divergence expected, else it was the adapter's) and on our
  ``kvspec.impl.prefix.PrefixCachePool`` (exit 0 expected); only a finding that
  does all three is confirmed;
* a refusal the adapter makes itself on an op the spec accepts, and an
  exception of the adapter's own code, are the harness's failure
  (:class:`HarnessFailure`): the class ends without a verdict, never with a
  finding;
* the op class the finding is charged to (:func:`op_class`: the op, split
  where vLLM's code paths split) is then no longer generated, and the next
  round starts.

A class ends when a round spends its examples without a divergence, when
``max_findings`` are found, or when nothing is left to exclude. The search
is budgeted by examples (``examples`` per round), not seconds: the report
gives the seconds and ops per second it took.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.fuzz.commands.conformance import ClassReport
from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.failures import HarnessFailure as LockstepHarnessFailure
from kvspec.fuzz.trace import TraceFormatError

#: the class searched: its name and what it runs
CLASS = "KVCacheManager"
CLASSES = (CLASS,)
#: a refusal difference: the spec refuses, the engine does something else (a
#: contract difference when it leaves the state as the spec's, else a fault)
REFUSAL_RULES = ("refusal",)
DEFAULT_SEED = 20261206
#: the search's default budget: examples per round, ops per example
DEFAULT_EXAMPLES = 300
DEFAULT_STEPS = 40
DEFAULT_MAX_FINDINGS = 16
#: token ids drawn (a small vocabulary: decodes repeat the prompts' tokens)
VOCAB = 4
#: request ids (at most MAX_LIVE live at once)
NAMES = ("a", "b", "c", "d", "e")
MAX_LIVE = 3

_RULE = re.compile(r"rule '([^']+)'")


def rule_of(what: str) -> str:
    """The rule a divergence names (``rule 'refcount'``), else its text up
    to its first parenthesis (``target crashed while ...``)."""
    m = _RULE.search(what)
    return m.group(1) if m else what.split(" (")[0]


#: op classes where the spec answers no (refused for room) and changes nothing
NEGATIVE_CLASSES = ("decode without room", "decode without room after a window release", "admit not admitted",
                    "resume not admitted")


def category(what: str, state_differs: bool = True, op_class: str = "") -> str:
    """``"fault"``, ``"contract difference"`` or ``"refusal changes
    state"``: a refusal the engine does not make (or makes otherwise) that
    leaves its state as the spec's is a contract difference; an op the spec
    answers no for room (``op_class`` in :data:`NEGATIVE_CLASSES`) after
    which the engine's state differs is a refusal that changes state (vLLM:
    a sliding window's blocks released before the room check,
    docs/prefix.md Decision 7); every other divergence is a fault."""
    if rule_of(what) in REFUSAL_RULES and not state_differs:
        return "contract difference"
    if op_class in NEGATIVE_CLASSES and rule_of(what) not in REFUSAL_RULES and rule_of(what) != "result":
        return "refusal changes state"
    return "fault"


# -- the spec's side ----------------------------------------------------------


def new_world(cache: dict[str, Any]) -> Any:
    from kvspec.fuzz.prefix import spec_world

    return spec_world(cache)


def spec_step(world: Any, op: dict[str, Any]) -> tuple[bool, Any]:
    """``(refused, world after op)`` on the spec (an ``expect`` changes nothing)."""
    from kvspec.fuzz.prefix import _spec_op
    from kvspec.spec import prefix as sp
    from kvspec.spec.errors import KVCacheError

    if op["op"] == "expect":
        return False, world
    try:
        _, after = sp.apply_op(world, _spec_op(op))
    except KVCacheError:
        return True, world
    return False, after


def op_class(op: dict[str, Any], world: Any) -> str:
    """The class of ``op`` in the spec's ``world`` (before it): a partition
    of the op space along vLLM's code paths, not a list of its faults.

    * ``free_blocks`` (the spec refuses every call) by what it names: ``a
      held block twice``, ``a held block``, ``a free block``, ``out of
      range``, ``no block``;
    * ``free`` the spec refuses: ``of a request holding nothing`` (freed,
      never admitted) or ``of a preempted request``; any other op the spec
      refuses: ``<op> the spec refuses``;
    * ``admit`` and ``resume`` by their outcome: ``not admitted``,
      ``evicting`` (a popped block had a key), ``hitting cached-free
      blocks``, ``hitting``, ``missing``;
    * ``decode``: ``without room`` (``after a window release``: a sliding
      window would release blocks first), ``evicting``, ``releasing blocks
      before the window``, ``filling a block`` (a block becomes full, so
      keyed), else ``decode``;
    * ``lookup``: ``hitting`` or ``missing``; ``reset``: ``refused`` or not;
      ``free``, ``preempt`` as they are."""
    from kvspec.spec import prefix as sp

    name = op["op"]
    refused, after = spec_step(world, op)
    if name == "free_blocks":
        blocks = op.get("blocks")
        n = world.n_blocks
        if not isinstance(blocks, list) or not blocks:
            return "free_blocks of no block"
        if any(not isinstance(b, int) or not 0 <= b < n for b in blocks):
            return "free_blocks out of range"
        if len(set(blocks)) < len(blocks):
            held = any(world.blocks[b].refcount > 0 for b in blocks if blocks.count(b) > 1)
            return "free_blocks a held block twice" if held else "free_blocks a free block twice"
        if any(world.blocks[b].refcount == 0 for b in blocks):
            return "free_blocks a free block"
        return "free_blocks a held block"
    if refused:
        if name == "free":
            q = world.requests.get(op.get("req"))
            return "free of a preempted request" if q is not None else "free of a request holding nothing"
        return f"{name} the spec refuses"
    if name in ("admit", "resume"):
        if after is world:
            return f"{name} not admitted"
        if _evicts(world, after):
            return f"{name} evicting"
        q = after.requests[op["req"]]
        hit_blocks = _hit_blocks(world, q)
        if any(b is not None and world.blocks[b].refcount == 0 for b in q.table[:hit_blocks]):
            return f"{name} hitting cached-free blocks"
        return f"{name} hitting" if hit_blocks else f"{name} missing"
    if name == "decode":
        before_q = world.requests[op["req"]]
        if after is world:
            if world.window is not None and sp._slide(world, before_q)[1] is not world:
                return "decode without room after a window release"
            return "decode without room"
        if _evicts(world, after):
            return "decode evicting"
        after_q = after.requests[op["req"]]
        if sum(b is None for b in after_q.table) > sum(b is None for b in before_q.table):
            return "decode releasing blocks before the window"
        bs = world.block_size
        if len(after_q.tokens) // bs > len(before_q.tokens) // bs:
            return "decode filling a block"
        return "decode"
    if name == "lookup":
        return "lookup hitting" if sp.lookup(world, tuple(op["tokens"]), op.get("salt")) else "lookup missing"
    if name == "reset":
        return "reset" if after is not world else "reset refused"
    return name


def _evicts(before: Any, after: Any) -> bool:
    return any(b.key is not None and b.refcount == 0 and after.blocks[i].key != b.key
               for i, b in enumerate(before.blocks))


def _hit_blocks(world: Any, q: Any) -> int:
    from kvspec.spec import prefix as sp

    return sp.hit_blocks(world, q.salt, tuple(q.tokens))


def classify(op: dict[str, Any], world: Any) -> tuple[str, Any]:
    """``(op_class, the spec's world after op)``."""
    return op_class(op, world), spec_step(world, op)[1]


# -- generation -----------------------------------------------------------------


class Generator:
    """Seeded ops drawn from the spec's state (the module's doc), skipping
    the op classes in ``excluded``."""

    def __init__(self, rng: random.Random, cache: dict[str, Any], excluded: frozenset[str]):
        self.rng, self.cache, self.excluded = rng, cache, excluded
        self.bs = cache["block_size"]
        r, bs = rng, self.bs
        root = self.tokens(r.choice([bs, bs, 2 * bs, bs + 1, 1]))
        prompts = [root + self.tokens(r.choice([bs, 0, 1, 2 * bs]))]
        for i in range(1, r.randint(2, 3)):
            if r.random() < 0.5:
                prompts.append(prompts[0] + self.tokens(r.choice([bs, 1])))
            else:
                prompts.append(root + [(root[-1] + i) % VOCAB] + self.tokens(r.choice([bs - 1, bs, 2 * bs - 1])))
        self.prompts = prompts
        self.admitted: set[str] = set()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(max(0, n))]

    # -- the spec's state
    def live(self, world: Any) -> list[str]:
        return sorted(r for r, q in world.requests.items() if q.live)

    def preempted(self, world: Any) -> list[str]:
        return sorted(r for r, q in world.requests.items() if not q.live)

    def idle(self, world: Any) -> list[str]:
        return [r for r in NAMES if r not in world.requests]

    def prompt(self) -> list[int]:
        r, bs = self.rng, self.bs
        p = list(r.choice(self.prompts))
        how = r.choice(["whole", "whole", "blocks", "longer", "blocks+1"])
        if how == "blocks" and len(p) > bs:
            p = p[: (len(p) // bs) * bs]
        elif how == "blocks+1" and len(p) > bs + 1:
            p = p[: (len(p) - 1) // bs * bs + 1]
        elif how == "longer":
            p = p + self.tokens(1)
        return p

    def salt(self) -> Any:
        return self.rng.choice([None, None, None, None, 0, 1])

    def admit_op(self, req: str, tokens: list[int], salt: Any = None) -> dict[str, Any]:
        # (``ops`` records the request as admitted once the sequence is allowed: a composite draw
        # dropped for an excluded class must not leave a request the trace never admitted)
        op: dict[str, Any] = {"op": "admit", "req": req, "tokens": list(tokens)}
        if salt is not None:
            op["salt"] = salt
        return op

    def continuation(self, world: Any, req: str, n: int) -> list[int]:
        toks = list(world.requests[req].tokens)
        for p in self.prompts:
            if len(p) > len(toks) and p[: len(toks)] == toks:
                return (p[len(toks):] + [0] * n)[:n]
        return self.tokens(n)

    # -- drawing
    def ops(self, world: Any) -> list[dict[str, Any]]:
        """One op, or a short sequence of them (each checked against
        ``excluded`` in the spec's state it runs in)."""
        for _ in range(20):
            choice = self.rng.choices(
                ["admit", "decode", "free", "preempt", "resume", "lookup", "reset", "free_blocks", "share",
                 "churn", "exhaust", "reset_all", "salted", "preempt_resume"],
                weights=[18, 20, 9, 4, 4, 6, 2, 5, 5, 5, 3, 2, 3, 5])[0]
            out = getattr(self, "draw_" + choice)(world)
            if out and self.allowed(out, world):
                for op in out:
                    if op["op"] == "admit":
                        self.admitted.add(op["req"])
                return out
        return [{"op": "lookup", "tokens": self.prompt()}]

    def allowed(self, ops: list[dict[str, Any]], world: Any) -> bool:
        for op in ops:
            cls, world = classify(op, world)
            if cls in self.excluded:
                return False
        return True

    def draw_admit(self, world: Any) -> list[dict[str, Any]]:
        r = self.rng
        live, idle = self.live(world), self.idle(world)
        if len(live) >= MAX_LIVE or not idle:
            return [self.admit_op(live[0], self.prompt())] if live else []
        if r.random() < 0.05 and self.preempted(world):
            return [self.admit_op(self.preempted(world)[0], self.prompt())]  # the spec refuses
        tokens = [] if r.random() < 0.04 else self.prompt()
        return [self.admit_op(idle[0], tokens, self.salt())]

    def draw_decode(self, world: Any) -> list[dict[str, Any]]:
        r = self.rng
        live = self.live(world)
        if not live:
            waiting = self.preempted(world)
            return [{"op": "decode", "req": waiting[0], "tokens": [0]}] if waiting and r.random() < 0.2 else []
        req = r.choice(live)
        n = r.randint(1, 2)
        tokens = self.tokens(n) if r.random() < 0.5 else self.continuation(world, req, n)
        return [{"op": "decode", "req": req, "tokens": tokens}]

    def draw_free(self, world: Any) -> list[dict[str, Any]]:
        r = self.rng
        live = self.live(world)
        gone = sorted(self.admitted - set(world.requests))
        if gone and (not live or r.random() < 0.15):
            return [{"op": "free", "req": r.choice(gone)}]
        if self.preempted(world) and r.random() < 0.1:
            return [{"op": "free", "req": self.preempted(world)[0]}]
        return [{"op": "free", "req": r.choice(live)}] if live else []

    def draw_preempt(self, world: Any) -> list[dict[str, Any]]:
        live = self.live(world)
        if live:
            return [{"op": "preempt", "req": self.rng.choice(live)}]
        gone = sorted(self.admitted - set(world.requests))
        return [{"op": "preempt", "req": gone[0]}] if gone else []

    def draw_resume(self, world: Any) -> list[dict[str, Any]]:
        waiting, live = self.preempted(world), self.live(world)
        if waiting and len(live) < MAX_LIVE:
            return [{"op": "resume", "req": self.rng.choice(waiting)}]
        return [{"op": "resume", "req": live[0]}] if live else []

    def draw_lookup(self, world: Any) -> list[dict[str, Any]]:
        op: dict[str, Any] = {"op": "lookup", "tokens": self.prompt()}
        salt = self.salt()
        if salt is not None:
            op["salt"] = salt
        return [op]

    def draw_reset(self, world: Any) -> list[dict[str, Any]]:
        return [{"op": "reset"}]

    def draw_free_blocks(self, world: Any) -> list[dict[str, Any]]:
        r = self.rng
        held = sorted({b for q in world.requests.values() if q.live for b in q.table if b is not None})
        free = list(world.free)
        how = r.choice(["twice", "twice", "held", "free", "free", "out of range", "none"])
        if how == "twice" and held:
            b = r.choice(held)
            return [{"op": "free_blocks", "blocks": [b, b]}]
        if how == "held" and held:
            return [{"op": "free_blocks", "blocks": [r.choice(held)]}]
        if how == "free" and free:
            return [{"op": "free_blocks", "blocks": [r.choice(free)]}]
        if how == "none":
            return [{"op": "free_blocks", "blocks": []}]
        return [{"op": "free_blocks", "blocks": [r.choice([world.n_blocks, -1])]}]

    # composite draws: planned on the spec's state as it goes
    def _plan(self, world: Any, ops: list[dict[str, Any]]) -> Any:
        for op in ops:
            world = spec_step(world, op)[1]
        return world

    def _room(self, world: Any, want: int) -> list[dict[str, Any]]:
        """Frees (of the first live requests) until ``want`` more may go live."""
        out: list[dict[str, Any]] = []
        while self.live(world) and (len(self.live(world)) + want > MAX_LIVE or len(self.idle(world)) < want):
            op = {"op": "free", "req": self.live(world)[0]}
            out.append(op)
            world = spec_step(world, op)[1]
        return out if len(self.idle(world)) >= want else []

    def draw_share(self, world: Any) -> list[dict[str, Any]]:
        out = self._room(world, 2)
        world = self._plan(world, out)
        if len(self.idle(world)) < 2:
            return []
        tokens, salt = self.prompt(), self.salt()
        a, b = self.idle(world)[:2]
        return out + [self.admit_op(a, tokens, salt), self.admit_op(b, tokens, salt)]

    def draw_churn(self, world: Any) -> list[dict[str, Any]]:
        out = self._room(world, 1)
        world = self._plan(world, out)
        if not self.idle(world):
            return []
        req = self.idle(world)[0]
        first = self.prompt()
        out += [self.admit_op(req, first), {"op": "free", "req": req}, self.admit_op(req, self.prompt()),
                {"op": "free", "req": req}, self.admit_op(req, first)]
        return out

    def draw_exhaust(self, world: Any) -> list[dict[str, Any]]:
        longest = max(self.prompts, key=len)
        salt = self.salt()
        out: list[dict[str, Any]] = []
        for _ in range(MAX_LIVE):
            if len(self.live(world)) >= MAX_LIVE or not self.idle(world):
                break
            op = self.admit_op(self.idle(world)[0], longest + self.tokens(1), salt)
            after = spec_step(world, op)[1]
            out.append(op)
            if after is world:
                break
            world = after
        live = self.live(world)
        if live:
            req = live[-1]
            for _ in range(world.n_blocks * self.bs + 1):
                op = {"op": "decode", "req": req, "tokens": self.tokens(1)}
                after = spec_step(world, op)[1]
                out.append(op)
                if after is world:
                    break
                world = after
        return out

    def draw_preempt_resume(self, world: Any) -> list[dict[str, Any]]:
        """A request admitted (or a live one), decoded by a token, preempted
        (its blocks cached-free), another admitted between now and then,
        and resumed: it hits its own blocks unless the other took them."""
        out: list[dict[str, Any]] = []
        live = self.live(world)
        if live and self.rng.random() < 0.5:
            req = self.rng.choice(live)
        else:
            out = self._room(world, 1)
            world = self._plan(world, out)
            if not self.idle(world):
                return []
            req = self.idle(world)[0]
            op = self.admit_op(req, self.prompt(), self.salt())
            out.append(op)
            world = spec_step(world, op)[1]
            if req not in world.requests:
                return out
        op = {"op": "decode", "req": req, "tokens": self.continuation(world, req, 1)}
        out += [op, {"op": "preempt", "req": req}]
        world = self._plan(world, out[-2:])
        if self.rng.random() < 0.5 and self.idle(world):
            other = self.admit_op(self.idle(world)[0], self.prompt())
            out.append(other)
        return out + [{"op": "resume", "req": req}]

    def draw_reset_all(self, world: Any) -> list[dict[str, Any]]:
        out = [{"op": "reset"}]
        for req in self.live(world):
            out.append({"op": "preempt" if self.rng.random() < 0.5 else "free", "req": req})
        return out + [{"op": "reset"}]

    def draw_salted(self, world: Any) -> list[dict[str, Any]]:
        out = self._room(world, 2)
        world = self._plan(world, out)
        if len(self.idle(world)) < 2:
            return []
        tokens = self.prompt()
        salt = self.rng.choice([0, 1])
        a, b = self.idle(world)[:2]
        return out + [self.admit_op(a, tokens), {"op": "lookup", "tokens": list(tokens), "salt": salt},
                      self.admit_op(b, tokens, salt)]


def draw_cache(rng: random.Random) -> dict[str, Any]:
    """An example's cache fields: block size 1 to 4, 4 to 12 blocks, a
    window (None, full attention, three times in ten; else a sliding window
    of 1 to 5 tokens, 2 and 3 most often)."""
    cache = {"kind": "prefix", "mode": "fp16", "block_size": rng.randint(1, 4), "n_blocks": rng.randint(4, 12),
             "window": None, "kv_heads": 1, "head_dim": 8, "dtype": "float16"}
    cache["window"] = rng.choice([None, None, None, 1, 2, 2, 3, 3, 4, 5])
    return cache


# -- replay and shrinking --------------------------------------------------------


class HarnessFailure(RuntimeError):
    """The tool, not vLLM, is at fault: the adapter refused an op the spec
    accepts (its own request-level rules must agree with the spec's), the
    adapter's own code raised, or a divergence vanished in paranoid mode.
    Never a finding: the search stops the class with ``no_verdict``."""


def lockstep(cache: dict[str, Any], on_vllm: bool, paranoid: bool = False) -> Any:
    """A fresh lockstep: the spec beside vLLM (``on_vllm``; in paranoid mode
    with ``paranoid``) or beside our ``kvspec.impl.prefix.PrefixCachePool``."""
    from kvspec.fuzz.prefix import PrefixLockstep

    if not on_vllm:
        return PrefixLockstep(cache, None)
    from kvspec.fuzz.adapters.vllm import make_lockstep

    return make_lockstep(cache, paranoid)


@dataclass
class Outcome:
    """A replay's first divergence (None: none) and, for a refusal
    divergence, whether the engine's state then differs from the spec's
    (``state``: the first differing field, or "")."""

    divergence: Divergence | None
    state: str = ""


def run_ops(cache: dict[str, Any], ops: list[dict[str, Any]], on_vllm: bool, paranoid: bool = False) -> Outcome:
    """Replay ``ops`` from a fresh pool; the first divergence. A trace the
    lockstep cannot run (a request named before any admit of it, after
    shrinking) counts as no divergence. Raises :class:`HarnessFailure`
    when the adapter's own code raised, or when the divergence is a refusal
    the adapter made itself (before calling vLLM) where the spec accepts."""
    lock = lockstep(cache, on_vllm, paranoid)
    try:
        for i, op in enumerate(ops):
            lock.step(i, op)
    except LockstepHarnessFailure as exc:
        raise HarnessFailure(str(exc)) from exc
    except Divergence as d:
        first = getattr(getattr(lock, "target", None), "refused_first", None)
        if on_vllm and first is not None and rule_of(d.what) == "refusal":
            raise HarnessFailure(f"op {d.index} ({_describe(d.op)}): the adapter refused it before calling vLLM "
                                 f"({first}) where the spec accepts it (or refuses it otherwise): a rule of the "
                                 "harness, not vLLM's answer") from None
        state = ""
        if rule_of(d.what) in REFUSAL_RULES:
            try:
                lock.compare_view(d.index, d.op)
            except Divergence as after:
                state = after.what.split(" differs")[0]
            except Exception as exc:  # noqa: BLE001 - a state that cannot be read differs
                state = f"unreadable ({type(exc).__name__})"
        return Outcome(d, state)
    except TraceFormatError:
        return Outcome(None)
    return Outcome(None)


def first_divergence(cache: dict[str, Any], ops: list[dict[str, Any]], on_vllm: bool,
                     paranoid: bool = False) -> Divergence | None:
    """The first divergence of ``ops`` (:func:`run_ops`), or None."""
    return run_ops(cache, ops, on_vllm, paranoid).divergence


def _class_at(cache: dict[str, Any], ops: list[dict[str, Any]], index: int) -> str:
    """The class of ``ops[index]`` in the spec's world after the ops before it."""
    world = new_world(cache)
    for i, op in enumerate(ops):
        if i == index:
            return op_class(op, world)
        world = spec_step(world, op)[1]
    raise IndexError(index)


def same_divergence(cache: dict[str, Any], ops: list[dict[str, Any]], rule: str, op_name: str,
                    cls: str | None = None) -> int | None:
    """The index of ``ops``'s first divergence on vLLM when it is the same
    one (the same rule, at an op named ``op_name``, of class ``cls`` when
    given), else None (a harness failure counts as None)."""
    try:
        d = first_divergence(cache, ops, True)
    except HarnessFailure:
        return None
    if d is None or rule_of(d.what) != rule or d.op["op"] != op_name:
        return None
    if cls is not None and _class_at(cache, ops, d.index) != cls:
        return None
    return d.index


def shrink(cache: dict[str, Any], ops: list[dict[str, Any]], rule: str, op_name: str,
           cls: str | None = None) -> list[dict[str, Any]]:
    """A 1-minimal op list that still diverges on vLLM the same way
    (:func:`same_divergence`): the ops after the divergence cut, then, until
    nothing changes, single ops removed (last first, op 0 included), token
    lists halved and cut by their last token. The result loses that
    divergence when any one of its ops is removed."""
    def same(candidate: list[dict[str, Any]]) -> int | None:
        return same_divergence(cache, candidate, rule, op_name, cls)

    ops = [dict(op) for op in ops]
    at = same(ops)
    if at is None:
        return ops
    ops = ops[:at + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops) - 1, -1, -1):
            cand = ops[:i] + ops[i + 1:]
            if cand and (j := same(cand)) is not None:
                ops, changed = cand[:j + 1], True
                break
        if changed:
            continue
        for i, op in enumerate(ops):
            toks = op.get("tokens")
            if not isinstance(toks, list) or len(toks) < 2:
                continue
            for shorter in (toks[: len(toks) // 2], toks[:-1]):
                cand = ops[:i] + [{**op, "tokens": shorter}] + ops[i + 1:]
                if (j := same(cand)) is not None:
                    ops, changed = cand[:j + 1], True
                    break
            if changed:
                break
    return ops


def spec_refused(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[bool]:
    """Per op, whether the spec refuses it in the state the ops before it leave."""
    world = new_world(cache)
    out = []
    for op in ops:
        refused, world = spec_step(world, op)
        out.append(refused)
    return out


def annotate_refusals(cache: dict[str, Any], ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ops`` with ``"error": true`` on every op the spec refuses (a trace
    states the refusals it expects: ``kvspec replay`` checks them)."""
    return [{**op, "error": True} if r else {k: v for k, v in op.items() if k != "error"}
            for op, r in zip(ops, spec_refused(cache, ops))]


# -- the search ------------------------------------------------------------------


@dataclass
class PrefixFinding:
    """One divergence class: what, where (``index``: the op it shows at, of
    class ``excluded``), its minimal trace, its category (``state``: for a
    refusal difference, the first field of the engine's state that then
    differs from the spec's; "" when none does: a contract difference) and
    replays: ``on_target`` / ``on_impl`` the replay's exit on vLLM / on ours,
    ``on_paranoid`` 1 when vLLM in paranoid mode diverges the same way.
    Confirmed: 1, 0, 1; any other finding is the tool's failure."""

    cache_class: str
    index: int
    op: dict[str, Any]
    what: str
    summary: str
    trace: str
    excluded: str
    examples_to_catch: int
    state: str = ""
    on_target: int | None = None
    on_impl: int | None = None
    on_paranoid: int | None = None

    @property
    def rule(self) -> str:
        return rule_of(self.what)

    @property
    def category(self) -> str:
        return category(self.what, bool(self.state), self.excluded)

    @property
    def confirmed(self) -> bool:
        return self.on_target == 1 and self.on_impl == 0 and self.on_paranoid == 1

    @property
    def replay_command(self) -> str:
        return f"kvspec replay --target vllm {self.trace}"


@dataclass
class PrefixClassReport(ClassReport):
    """What fuzzing vLLM's manager found: mlx-lm's class report (the
    conformance schema) with the search's own rates."""

    target: str = "vllm"
    kind: str = "prefix"
    mode: str = "full attention"
    findings: list[PrefixFinding] = field(default_factory=list)  # type: ignore[assignment]
    #: ops per second while running examples (shrinking and replays not counted)
    ops_per_second: float = 0.0
    #: seconds spent running examples (the rest: shrinking, replays)
    example_seconds: float = 0.0
    #: examples per round (the budget)
    rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        for f, doc in zip(self.findings, out["findings"]):
            doc["then"] = f"stopped generating {f.excluded}"
            doc["rule"] = f.rule
            doc["waived"] = []
        return out


def run_example(rng: random.Random, excluded: frozenset[str], steps: int, covered: dict[str, int],
                classes: dict[str, int] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], Divergence | None]:
    """One example: a pool and prompts drawn, then ops drawn and run until
    ``steps`` or a divergence. ``covered`` counts ops by name, ``classes``
    by :func:`op_class`."""
    cache = draw_cache(rng)
    lock = lockstep(cache, True)
    gen = Generator(rng, cache, excluded)
    ops: list[dict[str, Any]] = []
    try:
        while len(ops) < steps:
            for op in gen.ops(lock.world):
                if classes is not None:
                    cls = op_class(op, lock.world)
                    classes[cls] = classes.get(cls, 0) + 1
                ops.append(op)
                covered[op["op"]] = covered.get(op["op"], 0) + 1
                lock.step(len(ops) - 1, op)
    except Divergence as d:
        return cache, ops, d
    except LockstepHarnessFailure as exc:
        raise HarnessFailure(f"{exc} (example ops: {json.dumps(ops)[:2000]})") from exc
    return cache, ops, None


def search_class(examples: int, steps: int, seed: int, out: Path,
                 max_findings: int = DEFAULT_MAX_FINDINGS, progress: Any = None) -> PrefixClassReport:
    """Fuzz vLLM's manager in rounds of ``examples`` examples."""
    from kvspec.fuzz.adapters.vllm import DECLARED

    report = PrefixClassReport(CLASS, not_compared=dict(DECLARED), rounds=examples)
    classes: dict[str, int] = {}
    excluded: frozenset[str] = frozenset()
    start = time.perf_counter()
    k = 0
    while len(report.findings) < max_findings:
        failure = None
        for _ in range(examples):
            rng = random.Random(seed * 1000003 + k)
            k += 1
            t0 = time.perf_counter()
            try:
                cache, ops, d = run_example(rng, excluded, steps, report.covered, classes)
            except HarnessFailure as exc:
                report.no_verdict = f"tool failure: {exc}"
                break
            report.example_seconds += time.perf_counter() - t0
            report.examples += 1
            report.steps += len(ops)
            if progress is not None:
                progress(report)
            if d is not None:
                failure = (cache, ops, d, report.examples)
                break
        if report.no_verdict:
            report.ended = "stopped: the harness failed (no verdict)"
            break
        if failure is None:
            report.ended = f"{examples} examples without a further divergence"
            break
        cache, ops, d, at = failure
        try:
            cls = _class_at(cache, ops, d.index)
            minimal = shrink(cache, ops, rule_of(d.what), d.op["op"], cls)
            finding = record(cache, minimal, d.what, cls, at, out, len(report.findings) + 1)
        except HarnessFailure as exc:
            report.no_verdict = f"tool failure: {exc}"
            report.ended = "stopped: the harness failed (no verdict)"
            break
        report.findings.append(finding)
        if cls in excluded:
            report.ended = f"stopped: {cls} diverged although excluded"
            break
        excluded = excluded | {cls}
    else:
        report.ended = f"{max_findings} findings (max)"
    report.seconds = time.perf_counter() - start
    report.ops_per_second = report.steps / report.example_seconds if report.example_seconds else 0.0
    report.skipped = {}
    report.covered = {**report.covered, **{f"class: {c}": n for c, n in sorted(classes.items())}}
    return report


def record(cache: dict[str, Any], ops: list[dict[str, Any]], what: str, cls: str, at: int, out: Path,
           number: int) -> PrefixFinding:
    """Write the minimal trace ``KVCacheManager_NN.json`` and replay it on
    vLLM, on vLLM in paranoid mode and on ours."""
    from kvspec.fuzz.adapters.vllm import vllm_version

    ops = annotate_refusals(cache, ops)
    got = run_ops(cache, ops, True)
    d = got.divergence
    if d is None:
        summary = what
    else:
        then = f" (vLLM's state then differs: {got.state})" if got.state else \
            (" (both states equal after it)" if rule_of(d.what) in REFUSAL_RULES else "")
        summary = (f"op {d.index} {_describe(d.op)}: {d.what.split(' (rule')[0]}{then}: vllm {_short(d.impl)}, "
                   f"spec {_short(d.spec)}")
    doc = {"kvtrace": 1,
           "title": f"{vllm_version()} KVCacheManager does not conform (kvspec replay --target vllm): {summary}"[:600],
           "cache": dict(cache), "ops": ops}
    path = out / f"{CLASS}_{number:02d}.json"
    path.write_text(_dump(doc))
    finding = PrefixFinding(CLASS, d.index if d else -1, d.op if d else {}, d.what if d else what, summary,
                            str(path), cls, at, state=got.state)
    finding.on_target = 1 if d is not None else 0
    finding.on_impl = 1 if first_divergence(cache, ops, False) is not None else 0
    para = first_divergence(cache, ops, True, paranoid=True)
    finding.on_paranoid = int(para is not None and d is not None and para.index == d.index and para.what == d.what)
    return finding


def _describe(op: dict[str, Any]) -> str:
    return (op["op"] + " " + " ".join(f"{k}={json.dumps(v)}" for k, v in op.items() if k != "op")).strip()


def _short(x: Any) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= 240 else s[:237] + "..."


def _dump(doc: dict[str, Any]) -> str:
    """A trace as the project writes them: one op per line."""
    head = json.dumps({k: v for k, v in doc.items() if k != "ops"}, indent=2)[:-2]
    ops = ",\n".join("    " + json.dumps(op) for op in doc["ops"])
    return f"{head},\n  \"ops\": [\n{ops}\n  ]\n}}\n"


#: the files :func:`run_vllm_conformance` removed from its ``out`` before its last run
LAST_CLEARED: list[str] = []


def clear_findings(out: Path) -> list[str]:
    """Remove an earlier run's findings from ``out``: ``KVCacheManager_NN.json``
    and ``report.json`` (other files are kept). Returns the names removed."""
    gone = []
    for stale in sorted(out.glob(f"{CLASS}_[0-9][0-9].json")):
        stale.unlink()
        gone.append(stale.name)
    if (out / "report.json").exists():
        (out / "report.json").unlink()
        gone.append("report.json")
    return gone


def run_vllm_conformance(examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED,
                         out: str | Path = "fuzz-failures/conformance-vllm", only: list[str] | None = None,
                         max_findings: int = DEFAULT_MAX_FINDINGS, progress: Any = None) -> list[PrefixClassReport]:
    """Search vLLM's manager; ``KVCacheManager_NN.json`` traces and
    ``report.json`` are written to ``out`` after an earlier run's are
    removed (:data:`LAST_CLEARED`). Raises KeyError for an unknown class,
    NotInstalled without vLLM."""
    from kvspec.fuzz.adapters.vllm import require

    require()
    for n in only or ():
        if n not in CLASSES:
            raise KeyError(f"--class: unknown class {n!r}; vLLM's: {', '.join(CLASSES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    LAST_CLEARED[:] = clear_findings(out)
    reports = [search_class(examples, steps, seed, out, max_findings, progress)]
    (out / "report.json").write_text(json.dumps(to_json(reports, seed, examples, steps), indent=1) + "\n")
    return reports


def to_json(reports: list[PrefixClassReport], seed: int, examples: int, steps: int) -> dict[str, Any]:
    """The report (``kvspec conformance --json``'s schema): ``budget``
    counts examples per round (``budget_unit``), ``engine`` names vLLM's
    version; ``mlx_lm``/``mlx`` are the schema's fields. ``ok`` (and
    ``exit`` 0) only when every finding is confirmed (replays 1 on vLLM, in
    paranoid mode too, and 0 on ours) and no class ended without a verdict;
    ``exit`` 1 for a finding not confirmed, 2 for a class without a verdict."""
    import mlx.core as mx

    from kvspec.fuzz.adapters.mlx_lm import mlx_lm_version
    from kvspec.fuzz.adapters.vllm import vllm_version

    ok = all(f.confirmed for r in reports for f in r.findings) and not any(r.no_verdict for r in reports)
    code = 2 if any(r.no_verdict for r in reports) else 0 if ok else 1
    return {"target": "vllm", "engine": vllm_version(), "seed": seed,
            "budget": examples, "budget_unit": "examples per round", "steps": steps,
            "mlx_lm": mlx_lm_version(), "mlx": mx.__version__, "interrupted": False,
            "classes": [r.to_json() for r in reports], "ok": ok, "exit": code,
            "no_verdict": {r.cache_class: r.no_verdict for r in reports if r.no_verdict}}


def cmd_vllm_conformance(args: Any, console: Any, usage_error: Any, default_out: bool = False) -> int:
    """``kvspec conformance --target vllm``: exit 0 when every finding is
    confirmed (replays 1 on vLLM, in paranoid mode too, and 0 on ours), 1
    otherwise, 2 without vLLM, for an unknown ``--class``, an option of the
    seconds-budgeted search (``--budget``, ``--sarif``) or a class without
    a verdict. With the default ``--out`` the traces go to its subfolder
    ``vllm``."""
    from rich.markup import escape

    from kvspec.fuzz.adapters.vllm import NotInstalled

    for option, given in (("--budget", getattr(args, "budget", None) is not None),
                          ("--sarif", getattr(args, "sarif", None) is not None)):
        if given:
            return usage_error(console, f"{option}: does not apply to --target vllm (its search is budgeted by "
                                        "examples: --examples per round, --steps per example; its findings are in "
                                        "report.json)", args.json)
    examples = args.examples if getattr(args, "examples", None) is not None else DEFAULT_EXAMPLES
    max_findings = args.max_findings if args.max_findings is not None else DEFAULT_MAX_FINDINGS
    steps = args.steps if getattr(args, "steps", None) is not None else DEFAULT_STEPS
    out = str(Path(args.out) / "vllm") if default_out else args.out
    try:
        reports = run_vllm_conformance(examples, steps, args.seed, out, args.classes, max_findings)
    except NotInstalled as exc:
        return usage_error(console, str(exc), args.json)
    except KeyError as exc:
        return usage_error(console, str(exc.args[0]), args.json)
    doc = to_json(reports, args.seed, examples, steps)
    doc["cleared"] = list(LAST_CLEARED)
    code = doc["exit"]
    if args.json:
        print(json.dumps(doc))
        return code
    if LAST_CLEARED:
        console.print(f"removed the earlier run's {len(LAST_CLEARED)} files from {escape(str(out))}/ first "
                      f"({escape(', '.join(LAST_CLEARED[:6]))}{', ...' if len(LAST_CLEARED) > 6 else ''})")
    print_vllm_report(reports, doc, console)
    for r in reports:
        if r.no_verdict:
            console.print(f"[bold red]{escape(r.cache_class)}: no verdict[/]: {escape(r.no_verdict)}")
    console.print(f"minimal traces in {escape(str(out))}/ (report.json beside them)")
    return code


def print_vllm_report(reports: list[PrefixClassReport], doc: dict[str, Any], console: Any) -> None:
    """One row per class, then one per divergence, then the replay commands."""
    from rich.markup import escape
    from rich.table import Table

    from kvspec.fuzz.commands.reports import print_table

    table = Table(title=f"kvspec conformance: {doc['engine']}, seed {doc['seed']}, {doc['budget']} examples "
                        f"per round, {doc['steps']} ops per example")
    for col in ("class", "examples", "ops", "ops/s", "seconds", "faults", "contract differences", "search ended"):
        table.add_column(col, overflow="fold")
    for r in reports:
        faults = sum(f.category == "fault" for f in r.findings)
        table.add_row(escape(r.cache_class), str(r.examples), str(r.steps), f"{r.ops_per_second:.0f}",
                      f"{r.seconds:.1f}", str(faults), str(len(r.findings) - faults), escape(r.ended))
    print_table(console, table)
    found = Table(title="divergences (each trace replays 1 on vllm, in paranoid mode too, and 0 on impl)")
    for col in ("#", "category", "what goes wrong", "then", "replay"):
        found.add_column(col, overflow="fold")
    lines = []
    for r in reports:
        for i, f in enumerate(r.findings, 1):
            check = ("[green]1/0 ok[/]" if f.confirmed else
                     f"[bold red]{f.on_target}/{f.on_impl}, paranoid {f.on_paranoid}[/]")
            found.add_row(str(i), f.category, escape(f.summary[:240]), escape(f"stopped generating {f.excluded}"),
                          check)
            lines.append(f"{r.cache_class} #{i}: {f.replay_command}")
    print_table(console, found)
    for line in lines:
        console.print(line, soft_wrap=True, markup=False)

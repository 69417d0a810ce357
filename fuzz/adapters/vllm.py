"""vLLM's v1 KV-cache manager as a ``prefix`` target (``--target vllm``).

vLLM's ``KVCacheManager`` (``vllm/v1/core``: the manager, its ``BlockPool``
and the free-block queue) is pure-Python metadata: it runs on the CPU with
no tensor at all. :class:`VllmTarget` drives it as a
``kvspec.fuzz.prefix.PrefixTarget`` (docs/prefix.md, the protocol of
``kvspec.fuzz.prefix``):

* **Pool.** One ``FullAttentionSpec`` group of block size ``block_size``
  (1 KV head of 8, float32: only the metadata is used), or, with the cache
  field ``window`` = w, one ``SlidingWindowSpec(sliding_window=w)`` group
  (vLLM's ``SlidingWindowManager``); ``num_blocks = n_blocks + 1``: vLLM
  pops block 0 as its null block at start (never free), so vLLM's block
  ``b`` is the spec's ``b - 1``, and the null block in a sliding-window
  table (a block released by the window, or a hit block before the window)
  is the spec's None. Prefix caching on, sha256 block hashes, watermark 0.
* **Requests.** vLLM ``Request`` objects with the block hasher
  (``get_request_block_hasher``), the trace's ``salt`` as ``cache_salt``
  (``str(salt)``). The adapter plays the scheduler's part:
  ``admit`` = ``get_computed_blocks`` then ``allocate_slots(request,
  num_tokens - hit, hit, computed blocks)`` (the whole prompt in one
  step; None: not admitted, nothing changed), then the request RUNNING and
  every token computed; ``decode`` = ``append_output_token_ids`` then
  ``allocate_slots(request, n)`` (None: no room; the appended tokens and
  any block hash they completed are taken back, as the scheduler, which
  would preempt instead, never needs to); ``free`` =
  ``KVCacheManager.free``; ``preempt`` = what ``Scheduler._preempt_request``
  does to the manager and the request (free, PREEMPTED, no computed
  token); ``resume`` = the same ``Request`` admitted again (its prompt and
  output tokens); ``lookup`` = ``get_computed_blocks`` of a fresh request
  (no ``allocate_slots``); ``free_blocks`` = ``BlockPool.free_blocks`` of
  the blocks named (the pool's own release: the double-free probe);
  ``reset`` = ``reset_prefix_cache``.
* **Request-level rules** are the scheduler's and the engine's, not the
  manager's; the adapter applies them before it calls vLLM, as those do:
  an empty prompt (``InputProcessor``: "prompt cannot be empty"), a token
  that is not an int >= 0 (the input processor's vocabulary check), an
  admit of a running request id (the scheduler asserts "duplicate request
  id"), a preempt of a request that is not running (``_preempt_request``
  asserts it), a decode or a free of a preempted one and a resume of one
  that is not preempted (the scheduler runs only running requests and
  resumes only from its waiting queue). Each refusal is recorded
  (:attr:`VllmTarget.refused_first`): a search tells it from vLLM's own
  answers (on an op the spec accepts it is the harness's failure).
* **Observation** (:meth:`VllmTarget.observe`): each known request's table
  (the manager's ``req_to_blocks``, ids mapped back), token count and
  liveness (RUNNING), and every other request id the manager still holds
  blocks for; per block its ``ref_cnt`` and its ``block_hash`` named as the
  spec's key ``(salt, tokens)`` through a table the adapter keeps from
  each request's ``block_hashes`` (``block_hashes[i]`` names the first
  ``(i + 1) * B`` tokens and the salt); the free queue walked front to back
  through its links (at most ``num_blocks`` steps: a corrupted queue shows
  as such, never hangs); the cached map (``_cache``, and ``_dup_ids`` for a
  key cached by several blocks, in insertion order); and rows from the
  adapter's own row store keyed by (vLLM block id, slot), written as the
  model would after each admit, decode and resume: positions ``[hit or old
  length, new length)`` into slot ``p % B`` of ``table[p // B]``.
* **Whose failure.** An exception raised in vLLM's own code (e.g. the
  ``AssertionError`` of ``get_new_blocks`` after a double free drove a
  ``ref_cnt`` below 0) is vLLM's: the lockstep shows it as a divergence. One
  raised in the adapter's own code is the harness's
  (:attr:`VllmTarget.harness_error`): :class:`VllmLockstep` raises it as a
  ``kvspec.fuzz.failures.HarnessFailure`` (a tool failure, exit 2), never a
  divergence.
* **Paranoid mode** (``paranoid=True``): the view is read through other
  paths (tables through ``get_block_ids``, the free queue through vLLM's
  own ``get_all_free_blocks``, keys named by hashing every token sequence
  the adapter handed vLLM again with fresh ``Request`` objects), and the
  adapter checks its own bookkeeping after every op: each request's
  ``block_hashes`` equal those a fresh request of its tokens computes (so a
  decode taken back left no hash behind) and the row store holds a row for
  every position of every running request. A failed check is the
  harness's failure. ``kvspec conformance --target vllm`` confirms each
  finding in this mode.

Declared differences (:data:`DECLARED`, one place): what vLLM does
differently by contract, each with its reason; everything else is compared
exactly, block ids included.

Imports vLLM lazily; :func:`require` raises :class:`NotInstalled` naming
the install command without it (the CLI: exit 2).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvspec.fuzz.failures import Divergence, HarnessFailure, harness_dirs, raised_in
from kvspec.fuzz.prefix import PrefixLockstep, row_name
from kvspec.fuzz.targets import CacheClass, Target, TargetCapabilityError
from kvspec.spec.errors import InvalidArgumentError, KVCacheError, StateError

#: the vLLM release this target was built and checked against
VLLM_VERSION = "0.34.0"
#: how to install it (an extra cannot express pip's --no-deps: tools/install-vllm does)
INSTALL_HINT = ("tools/install-vllm (or: make vllm) installs vLLM 0.34.0 with --no-deps beside PyTorch's CPU "
                "build into .venv (docs/targets.md 'vLLM')")
#: token ids vLLM stores in an int32 array (vllm/v1/token_buffer.py)
MAX_TOKEN = 2**31 - 1

#: differences vLLM has by contract, rule -> why (kvspec.fuzz.prefix.PrefixLockstep
#: skips them and a replay lists them as not compared); nothing else is
#: excused
DECLARED: dict[str, str] = {
    "free refusal": ("a free of a request that holds nothing (freed before, or never admitted): "
                     "KVCacheManager.free ignores it (SingleTypeKVCacheManager.pop_blocks_for_free pops the "
                     "request id with a default), the spec refuses it; neither changes anything, and the "
                     "views are compared after it all the same"),
    "free_blocks refusal": ("BlockPool.free_blocks has no guard: it never refuses, where the spec refuses "
                            "every call (a block listed twice, a free block, a block a table holds). Only the "
                            "refusal is not compared: what the call did is, so a refcount it drives below "
                            "the number of holders (or below 0) is a finding at that op"),
}


class NotInstalled(RuntimeError):
    """vLLM is missing (the CLI exits 2 with the install command)."""


class AdapterRefusal(InvalidArgumentError):
    """A request-level argument the adapter refuses before calling vLLM, as
    vLLM's input processor or scheduler would (an empty prompt, a bad token,
    a duplicate request id)."""


class AdapterStateRefusal(StateError):
    """A request-level op out of turn, refused by the adapter before calling
    vLLM as vLLM's scheduler would (a preempt of a request that is not
    running, a resume of one that is not preempted, a decode or a free of a
    preempted one)."""


_V: SimpleNamespace | None = None


def require() -> SimpleNamespace:
    """vLLM's modules the target uses (imported once per process: 5 to 20
    s; ``init_none_hash(sha256)`` run once, so hashes are reproducible);
    raises :class:`NotInstalled` naming the install command."""
    global _V
    if _V is not None:
        return _V
    try:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus
    except ImportError as e:
        raise NotInstalled(f"--target vllm: vLLM not installed ({e.name} missing): {INSTALL_HINT}") from None
    import torch

    logging.getLogger("vllm").setLevel(logging.ERROR)
    kv_cache_utils.init_none_hash(sha256)
    _V = SimpleNamespace(vllm=vllm, SamplingParams=SamplingParams, sha256=sha256, utils=kv_cache_utils,
                         KVCacheManager=KVCacheManager, FullAttentionSpec=FullAttentionSpec,
                         SlidingWindowSpec=SlidingWindowSpec,
                         KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec, Request=Request,
                         RequestStatus=RequestStatus, torch=torch,
                         dir=os.path.dirname(vllm.__file__) + os.sep)
    return _V


def installed() -> bool:
    """Whether :func:`require` would succeed."""
    try:
        require()
    except NotInstalled:
        return False
    return True


def vllm_version() -> str:
    """``vllm 0.34.0`` or ``vllm not installed``."""
    try:
        v = require()
    except NotInstalled:
        return "vllm not installed"
    return f"vllm {getattr(v.vllm, '__version__', '?')}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: a stand-in for a request the adapter never built (KVCacheManager.free reads only its id)
def _stub(req: str) -> Any:
    return SimpleNamespace(request_id=req)


class VllmTarget:
    """vLLM's ``KVCacheManager`` (one full-attention or sliding-window
    group) as a ``kvspec.fuzz.prefix.PrefixTarget`` for a prefix trace's cache
    fields (``block_size``, ``n_blocks``, ``window``); the module's doc says how each op and
    the view are made. ``paranoid``: read the view through other paths
    and check the adapter's own bookkeeping after every op."""

    name = "vllm"
    declared = DECLARED

    def __init__(self, cfg: dict[str, Any], paranoid: bool = False):
        v = self.v = require()
        bs, n = cfg["block_size"], cfg["n_blocks"]
        if not (_is_int(bs) and bs >= 1 and _is_int(n) and n >= 1):
            raise InvalidArgumentError(f"vllm target: block_size {bs!r} and n_blocks {n!r} must be ints >= 1")
        w = cfg.get("window")
        if w is not None and not (_is_int(w) and w >= 1):
            raise InvalidArgumentError(f"vllm target: window {w!r} must be None or an int >= 1")
        self.block_size, self.n_blocks, self.window, self.paranoid = bs, n, w, paranoid
        if w is None:
            spec = v.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=v.torch.float32)
        else:
            spec = v.SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=v.torch.float32,
                                       sliding_window=w)
        group = v.KVCacheGroupSpec(layer_names=["layer0"], kv_cache_spec=spec)
        config = v.KVCacheConfig(num_blocks=n + 1, kv_cache_tensors=[], kv_cache_groups=[group])
        self.max_model_len = max(4096, (n + 2) * bs)
        self.manager = v.KVCacheManager(config, max_model_len=self.max_model_len, scheduler_block_size=bs,
                                        hash_block_size=bs, enable_caching=True)
        self.pool = self.manager.block_pool
        self.group = self.manager.coordinator.single_type_managers[0]
        self.hasher = v.utils.get_request_block_hasher(bs, v.sha256)
        #: requests the scheduler holds: RUNNING or PREEMPTED (id -> Request)
        self.requests: dict[str, Any] = {}
        #: requests freed or never admitted, kept so a free of them reaches vLLM
        self.gone: dict[str, Any] = {}
        #: each request's salt as the trace gave it
        self.salts: dict[str, Any] = {}
        #: block hash (without the group id) -> the spec's key (salt, tokens)
        self.names: dict[bytes, tuple[Any, tuple[int, ...]]] = {}
        #: every (salt, tokens) the adapter handed vLLM (paranoid mode names keys from these)
        self.sequences: set[tuple[Any, tuple[int, ...]]] = set()
        #: (vLLM block id, slot) -> the row name written there
        self.rows: dict[tuple[int, int], Any] = {}
        #: the refusal the adapter made itself in the last op (None: the op reached vLLM)
        self.refused_first: str | None = None
        #: an exception the adapter's own code raised in the last op (the harness's failure)
        self.harness_error: BaseException | None = None

    # -- whose exception -----------------------------------------------------

    def _begin(self) -> None:
        self.refused_first = None
        self.harness_error = None

    def _refuse(self, cls: type, message: str) -> KVCacheError:
        self.refused_first = message
        return cls(message)

    def _run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``: an exception raised in vLLM's code passes as vLLM's;
        one raised in the adapter's (or the harness's) own code, other than
        its deliberate refusals (``kvspec.spec.errors`` types), is recorded as
        :attr:`harness_error`. Paranoid: :meth:`self_check` after the op."""
        self._begin()
        try:
            out = fn(*args)
            if self.paranoid:
                self.self_check()
        except KVCacheError:
            raise
        except Exception as exc:
            self._blame(exc)
            raise
        return out

    def _blame(self, exc: BaseException) -> None:
        """Record ``exc`` as :attr:`harness_error` when the last frame of its
        traceback in either vLLM's package or the project's own (``fuzz/``,
        ``spec/``, ``impl/``) is the project's: the adapter raised it, or
        called a library (the stdlib, numpy) that did. vLLM's exceptions,
        and those of libraries vLLM called, are vLLM's."""
        dirs, _ = harness_dirs(False)
        last = None
        tb = exc.__traceback__
        while tb is not None:
            f = tb.tb_frame.f_code.co_filename
            if f.startswith(self.v.dir):
                last = "vllm"
            elif f.startswith(dirs):
                last = "harness"
            tb = tb.tb_next
        if last != "vllm":
            self.harness_error = exc

    # -- arguments -------------------------------------------------------------

    def _tokens(self, op: str, tokens: Any) -> list[int]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)):
            raise self._refuse(AdapterRefusal, f"{op}: tokens must be a list of token ids, got {tokens!r}")
        if not tokens:
            raise self._refuse(AdapterRefusal, f"{op}: tokens must not be empty (vLLM's input processor: "
                                               "'prompt cannot be empty'; a decode step has a token)")
        bad = [t for t in tokens if not _is_int(t) or not 0 <= t <= MAX_TOKEN]
        if bad:
            raise self._refuse(AdapterRefusal, f"{op}: token {bad[0]!r} is not a token id (an int in 0..2**31 - 1: "
                                               "vLLM's input processor and its int32 token buffer)")
        return [int(t) for t in tokens]

    def _salt(self, op: str, salt: Any) -> str | None:
        if salt is None:
            return None
        if not _is_int(salt) or salt < 0:
            raise self._refuse(AdapterRefusal, f"{op}: salt must be None or an int >= 0 (passed to vLLM as "
                                               f"cache_salt str(salt)), got {salt!r}")
        return str(salt)

    def _request(self, req: str, tokens: list[int], salt: Any) -> Any:
        v = self.v
        return v.Request(request_id=req, prompt_token_ids=list(tokens),
                         sampling_params=v.SamplingParams(max_tokens=1_000_000), pooling_params=None,
                         cache_salt=None if salt is None else str(salt), block_hasher=self.hasher)

    # -- ops -------------------------------------------------------------------

    def admit(self, req: str, tokens: tuple[int, ...], salt: Any = None) -> dict[str, Any]:
        return self._run(self._admit_new, req, tokens, salt)

    def _admit_new(self, req: str, tokens: Any, salt: Any) -> dict[str, Any]:
        toks = self._tokens("admit", tokens)
        self._salt("admit", salt)
        known = self.requests.get(req)
        if known is not None:
            if known.status == self.v.RequestStatus.RUNNING:
                raise self._refuse(AdapterRefusal, f"admit: request {req!r} is running (vLLM's scheduler asserts "
                                                   "'duplicate request id'); free it first")
            raise self._refuse(AdapterStateRefusal, f"admit: request {req!r} is preempted (in the scheduler's "
                                                    "waiting queue): resume it")
        r = self._request(req, toks, salt)
        got = self._admit(req, r, salt)
        if not got["admitted"]:
            self.gone[req] = r
        return got

    def _admit(self, req: str, r: Any, salt: Any) -> dict[str, Any]:
        """The scheduler's admission of a waiting or preempted request, its
        whole prompt (and, resumed, its outputs) in one step."""
        m = self.manager
        computed, hit, _ = m.get_computed_blocks(r)
        new = m.allocate_slots(r, r.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=computed)
        if new is None:
            return {"admitted": False, "hit": 0, "table": []}
        r.status = self.v.RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        self.requests[req] = r
        self.gone.pop(req, None)
        self.salts[req] = salt
        self._learn(req, r)
        self._write_rows(req, r, hit, r.num_tokens)
        return {"admitted": True, "hit": int(hit), "table": self._table(req)}

    def decode(self, req: str, tokens: tuple[int, ...]) -> bool:
        return self._run(self._decode, req, tokens)

    def _decode(self, req: str, tokens: Any) -> bool:
        toks = self._tokens("decode", tokens)
        r = self._running("decode", req)
        old, n_hashes = r.num_tokens, len(r.block_hashes)
        r.append_output_token_ids(toks)
        if self.manager.allocate_slots(r, len(toks)) is None:
            # take the tokens back (vLLM's scheduler would preempt the request instead)
            for _ in toks:
                r._output_token_ids.pop()
                del r._all_token_ids[-1]
            r.truncate_block_hashes(self.pool.hash_block_size)
            if self.paranoid and (r.num_tokens, len(r.block_hashes)) != (old, n_hashes):
                raise AssertionError(f"decode taken back: request {req!r} has {r.num_tokens} tokens and "
                                     f"{len(r.block_hashes)} block hashes, had {old} and {n_hashes}")
            return False
        r.num_computed_tokens += len(toks)
        self._learn(req, r)
        self._write_rows(req, r, old, r.num_tokens)
        return True

    def _running(self, op: str, req: str) -> Any:
        r = self.requests.get(req)
        if r is None:
            raise self._refuse(AdapterStateRefusal, f"{op}: no running request {req!r} (the scheduler runs only "
                                                    "the requests it holds)")
        if r.status != self.v.RequestStatus.RUNNING:
            raise self._refuse(AdapterStateRefusal, f"{op}: request {req!r} is preempted (in the scheduler's "
                                                    "waiting queue): resume it first")
        return r

    def free(self, req: str) -> None:
        return self._run(self._free, req)

    def _free(self, req: str) -> None:
        r = self.requests.get(req)
        if r is not None and r.status != self.v.RequestStatus.RUNNING:
            raise self._refuse(AdapterStateRefusal, f"free: request {req!r} is preempted: resume it first (the "
                                                    "spec's rule; vLLM's scheduler would abort it from its "
                                                    "waiting queue, which holds no block)")
        if r is None:
            # freed before or never admitted: vLLM's free of it (a no-op: the declared difference)
            self.manager.free(self.gone.get(req) or _stub(req))
            return
        self.manager.free(r)
        del self.requests[req]
        self.gone[req] = r

    def preempt(self, req: str) -> None:
        return self._run(self._preempt, req)

    def _preempt(self, req: str) -> None:
        r = self.requests.get(req)
        if r is None or r.status != self.v.RequestStatus.RUNNING:
            raise self._refuse(AdapterStateRefusal, f"preempt: request {req!r} is not running (vLLM's "
                                                    "Scheduler._preempt_request asserts 'Only running requests "
                                                    "can be preempted')")
        # Scheduler._preempt_request, as far as the manager and the request go
        self.manager.free(r)
        r.status = self.v.RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1

    def resume(self, req: str) -> dict[str, Any]:
        return self._run(self._resume, req)

    def _resume(self, req: str) -> dict[str, Any]:
        r = self.requests.get(req)
        if r is None or r.status != self.v.RequestStatus.PREEMPTED:
            raise self._refuse(AdapterStateRefusal, f"resume: request {req!r} is not preempted (the scheduler "
                                                    "resumes only from its waiting queue)")
        return self._admit(req, r, self.salts.get(req))

    def lookup(self, tokens: tuple[int, ...], salt: Any = None) -> int:
        return self._run(self._lookup, tokens, salt)

    def _lookup(self, tokens: Any, salt: Any) -> int:
        toks = self._tokens("lookup", tokens)
        self._salt("lookup", salt)
        _, hit, _ = self.manager.get_computed_blocks(self._request("kvspec-lookup", toks, salt))
        return int(hit)

    def free_blocks(self, blocks: tuple[int, ...]) -> None:
        return self._run(self._free_blocks, blocks)

    def _free_blocks(self, blocks: Any) -> None:
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, (list, tuple)):
            raise self._refuse(AdapterRefusal, f"free_blocks: blocks must be a list of block ids, got {blocks!r}")
        bad = [b for b in blocks if not _is_int(b) or not 0 <= b < self.n_blocks]
        if bad:
            raise self._refuse(AdapterRefusal, f"free_blocks: block {bad[0]!r} is not a block of the pool "
                                               f"(0..{self.n_blocks - 1}): BlockPool.free_blocks takes block "
                                               "objects, and there is none to hand it")
        self.pool.free_blocks([self.pool.blocks[b + 1] for b in blocks])

    def reset(self) -> bool:
        return self._run(lambda: bool(self.manager.reset_prefix_cache()))

    # -- bookkeeping -------------------------------------------------------------

    def _learn(self, req: str, r: Any) -> None:
        """Name each of the request's block hashes: ``block_hashes[i]`` names
        its salt and first ``(i + 1) * B`` tokens."""
        salt, bs = self.salts.get(req), self.block_size
        tokens = tuple(int(t) for t in r.all_token_ids)
        self.sequences.add((salt, tokens))
        for i, h in enumerate(r.block_hashes):
            self.names[bytes(h)] = (salt, tokens[: (i + 1) * bs])

    def _write_rows(self, req: str, r: Any, lo: int, hi: int) -> None:
        """The model's writes: the rows of positions ``[lo, hi)`` into slot
        ``p % B`` of the request's ``table[p // B]`` (vLLM's ids)."""
        salt, bs = self.salts.get(req), self.block_size
        tokens = tuple(int(t) for t in r.all_token_ids)
        table = [b.block_id for b in self.group.req_to_blocks.get(req, [])]
        for p in range(lo, hi):
            if p // bs < len(table) and table[p // bs] != 0:  # never into the null block
                self.rows[(table[p // bs], p % bs)] = row_name(salt, tokens, p)

    def _table(self, req: str) -> list[int]:
        """The request's table, the spec's ids. Paranoid: through the
        manager's ``get_block_ids`` (for a running request only: it reads a
        defaultdict, which would gain an entry for any other id)."""
        r = self.requests.get(req)
        if self.paranoid:
            running = r is not None and r.status == self.v.RequestStatus.RUNNING
            got = list(self.manager.get_block_ids(req)[0]) if running else \
                [b.block_id for b in self.group.req_to_blocks.get(req, [])]
        else:
            got = [b.block_id for b in self.group.req_to_blocks.get(req, [])]
        return [None if b == 0 else b - 1 for b in got]  # the null block: released by the window

    # -- the view ----------------------------------------------------------------

    def _key_name(self, key: Any, names: dict[bytes, Any]) -> Any:
        if key is None:
            return None
        h = bytes(key[:-4])
        got = names.get(h)
        if got is not None:
            group = int.from_bytes(key[-4:], "big")
            return got if group == 0 else (f"group {group}", got)
        return f"unnamed hash {h.hex()[:12]}"

    def _free_queue(self) -> list[int]:
        q = self.pool.free_block_queue
        if self.paranoid:
            return [b.block_id - 1 for b in q.get_all_free_blocks()]
        out: list[int] = []
        cur = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        while cur is not None and cur is not tail:
            if len(out) > len(self.pool.blocks):
                out.append("... (the queue's links loop)")  # type: ignore[arg-type]
                break
            out.append(cur.block_id - 1)
            cur = cur.next_free_block
        return out

    def _paranoid_names(self) -> dict[bytes, Any]:
        """Every block hash of every token sequence handed to vLLM,
        computed again by fresh requests (no incremental hashing)."""
        names: dict[bytes, Any] = {}
        bs = self.block_size
        for salt, tokens in self.sequences:
            r = self._request("kvspec-names", list(tokens), salt)
            for i, h in enumerate(r.block_hashes):
                names[bytes(h)] = (salt, tokens[: (i + 1) * bs])
        return names

    def observe(self) -> dict[str, Any]:
        try:
            return self._observe()
        except Exception as exc:
            self._blame(exc)
            raise

    def _observe(self) -> dict[str, Any]:
        pool, bs = self.pool, self.block_size
        names = self._paranoid_names() if self.paranoid else self.names
        running = self.v.RequestStatus.RUNNING
        requests: dict[str, Any] = {}
        for req, r in self.requests.items():
            requests[req] = {"table": self._table(req), "tokens": int(r.num_tokens), "live": r.status == running}
        for req, blocks in self.group.req_to_blocks.items():
            if req not in requests and blocks:  # the manager holds blocks for a request the scheduler let go
                requests[req] = {"table": [None if b.block_id == 0 else b.block_id - 1 for b in blocks],
                                 "tokens": None, "live": True}
        blocks = [(int(b.ref_cnt), self._key_name(b.block_hash, names)) for b in pool.blocks[1:]]
        cache = pool.cached_block_hash_to_block
        cached: dict[Any, list[int]] = {}
        for key, bid in cache._cache.items():
            ids = list(cache._dup_ids[key]) if key in cache._dup_ids else [bid]
            cached[self._key_name(key, names)] = [i - 1 for i in ids]
        rows = {(b, s): self.rows.get((b + 1, s)) for b in range(self.n_blocks) for s in range(bs)}
        reads = {}
        for req, q in requests.items():
            if q["live"] and req in self.requests:
                table = [0 if b is None else b + 1 for b in q["table"]]
                first = bs * next((i for i, b in enumerate(table) if b != 0), len(table))
                reads[req] = [self.rows.get((table[p // bs], p % bs)) if p // bs < len(table) else None
                              for p in range(first, q["tokens"])]
        return {"requests": requests, "blocks": blocks, "free": self._free_queue(), "cached": cached,
                "rows": rows, "reads": reads}

    def raw_state(self) -> Any:
        """vLLM's whole state, raw: every block's ref_cnt, hash and queue
        links, the cached map, the manager's per-request bookkeeping, each
        request's tokens, hashes, status and computed tokens."""
        pool = self.pool
        cache = pool.cached_block_hash_to_block
        return (
            [(b.ref_cnt, b.block_hash, getattr(b.prev_free_block, "block_id", None),
              getattr(b.next_free_block, "block_id", None)) for b in pool.blocks],
            pool.free_block_queue.num_free_blocks, dict(cache._cache),
            {k: list(v) for k, v in cache._dup_ids.items()},
            {k: [b.block_id for b in v] for k, v in self.group.req_to_blocks.items()},
            dict(self.group.num_cached_block),
            {k: (list(r.all_token_ids), list(r.block_hashes), r.status, r.num_computed_tokens)
             for k, r in self.requests.items()},
        )

    def self_check(self) -> None:
        """The adapter's own bookkeeping (paranoid mode, after every op):
        each known request's block hashes are those a fresh request of its
        tokens computes, and every position of a running request has its row
        in the row store. Raises AssertionError (the harness's failure)."""
        bs = self.block_size
        for req, r in self.requests.items():
            tokens = [int(t) for t in r.all_token_ids]
            fresh = self._request("kvspec-check", tokens, self.salts.get(req)).block_hashes
            if list(r.block_hashes) != list(fresh):
                raise AssertionError(f"adapter self-check: request {req!r}: {len(r.block_hashes)} block hashes "
                                     f"that a fresh request of its {len(tokens)} tokens does not compute")
            if r.status == self.v.RequestStatus.RUNNING:
                table = [b.block_id for b in self.group.req_to_blocks.get(req, [])]
                first = bs * next((i for i, b in enumerate(table) if b != 0), len(table))
                for p in range(first, len(tokens)):
                    want = row_name(self.salts.get(req), tokens, p)
                    if p // bs >= len(table) or self.rows.get((table[p // bs], p % bs)) is None:
                        raise AssertionError(f"adapter self-check: request {req!r} position {p}: no row "
                                             f"written (want {want!r})")


def target_factory(cache: dict[str, Any], paranoid: bool = False) -> VllmTarget:
    """A fresh vLLM manager for a prefix trace's ``cache`` fields
    (``kvspec.fuzz.prefix``: ``{"target": target_factory}``). NotInstalled without
    vLLM; a ``window`` runs one sliding-window group."""
    return VllmTarget(cache, paranoid=paranoid)


def paranoid_factory(cache: dict[str, Any]) -> VllmTarget:
    """:func:`target_factory` in paranoid mode."""
    return target_factory(cache, paranoid=True)


class VllmLockstep(PrefixLockstep):
    """``kvspec.fuzz.prefix.PrefixLockstep`` over vLLM: a divergence that came from
    an exception raised in the adapter's own code (not vLLM's) is raised as
    ``kvspec.fuzz.failures.HarnessFailure`` instead (a tool failure, exit 2)."""

    def _step(self, index: int, op: dict[str, Any]) -> None:
        try:
            super()._step(index, op)
        except Divergence:
            err = getattr(self.target, "harness_error", None)
            if err is not None:
                raise HarnessFailure(index, op, err, raised_in(err)) from err
            raise


def make_lockstep(cache: dict[str, Any], paranoid: bool = False) -> VllmLockstep:
    """A lockstep of the spec beside a fresh vLLM manager (in paranoid mode
    with ``paranoid``)."""
    VllmLockstep.check_cache(cache)
    return VllmLockstep(cache, {"target": paranoid_factory if paranoid else target_factory})


def trace_limits(cache: dict[str, Any], ops: list[dict[str, Any]]) -> str | None:
    """Why the target cannot run this trace at all, naming the field (None:
    it can): ``block_size`` or ``n_blocks`` not an int >= 1, a ``window``
    not None or an int >= 1. Checked before any op runs (``kvspec
    replay`` exit 2, not applicable), never a divergence. (A token id past
    vLLM's int32 token buffer is not a valid kvtrace: the schema caps token
    ids at 2**31 - 1.)"""
    w = cache.get("window")
    if w is not None and (not _is_int(w) or w < 1):
        return f"field cache.window: {w!r}: target vllm needs null or an int >= 1"
    for name in ("block_size", "n_blocks"):
        value = cache.get(name)
        if not _is_int(value) or value < 1:
            return f"field cache.{name}: {value!r}: target vllm needs an int >= 1"
    return None


@dataclass(frozen=True)
class VllmPrefixTarget(Target):
    """``--target vllm``: prefix traces replayed on vLLM's KV-cache manager
    (:class:`VllmTarget`) by :class:`VllmLockstep`. A trace of another
    kind, one past the target's limits (:func:`trace_limits`) or no vLLM:
    TargetCapabilityError naming why (``kvspec replay`` exit 2)."""

    def check(self, cache: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        if cache.get("kind") != "prefix":
            raise TargetCapabilityError(f"field cache.kind: target vllm runs prefix traces (vLLM's KV-cache "
                                        f"manager), this trace is {cache.get('kind')!r}")
        try:
            require()
        except NotInstalled as exc:
            raise TargetCapabilityError(str(exc)) from None
        why = trace_limits(cache, ops)
        if why is not None:
            raise TargetCapabilityError(f"{why} (target vllm)")

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        PrefixLockstep.check_cache(cache)
        self.check(cache, [])
        return make_lockstep(cache)


VLLM = VllmPrefixTarget(
    "vllm", f"vLLM {VLLM_VERSION}'s v1 KVCacheManager (one full-attention or sliding-window group, prefix "
            "caching on): the prefix kind",
    classes=(CacheClass("KVCacheManager", "prefix", "fp16", target_factory,
                        not_compared=dict(DECLARED), note=f"vLLM {VLLM_VERSION}"),),
    spec="vllm")

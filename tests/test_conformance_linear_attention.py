"""transformers' ``LinearAttentionLayer`` (``transformers.cache_utils``: the
conv window and recurrent state of hybrid models' linear-attention layers,
and their rollback ``activate_past_recording`` / ``crop(-n)``) against the
recurrent kind's rule (docs/recurrent.md, docs/conformance.md
"transformers LinearAttentionLayer"):

    after ``crop(-n)`` the layer holds exactly what it held after ``t - n``
    tokens: the conv window of the last ``kernel`` inputs (zero columns
    before the first token) AND the recurrent state; a rollback it cannot
    honour is refused with nothing changed.

transformers' own code runs: with PyTorch installed the real library, else
transformers' ``cache_utils.py`` executed on the NumPy stand-in of torch
(``tests/_torch_standin.py``, whose view and in-place semantics are tested
here too). :class:`Mixer` calls the layer as transformers' models do
(qwen3_next's GatedDeltaNet, mamba2's mixer: ``update_conv_state`` with the
block's inputs, ``update_recurrent_state`` with the state after the block,
or, while recording, the list of the states after each of its last
``min(recurrent_states_to_keep, S)`` tokens), so every finding below is the
call sequence a model and ``generate`` make.

Each finding is asserted as transformers 5.25 behaves (a fix upstream
flips the test: update docs/conformance.md then), and the rule checker
:func:`divergences` is asserted to report it; where every state is handed
over the same checker finds nothing, so it is not vacuous.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from . import _torch_standin

#: the conformance run's engine (docs/conformance.md quotes it)
TRANSFORMERS_VERSION = "5.25"


@contextlib.contextmanager
def _transformers() -> Iterator[tuple[Any, Any]]:
    if importlib.util.find_spec("torch") is not None:
        import torch
        from transformers import cache_utils

        yield torch, cache_utils
        return
    with pytest.MonkeyPatch.context() as mp:
        cache_utils = _torch_standin.install_cache_utils(mp)
        import torch

        yield torch, cache_utils


@pytest.fixture
def tf() -> Iterator[tuple[Any, Any]]:
    with _transformers() as got:
        yield got


def host(t: Any) -> np.ndarray:
    return np.array(t.detach().cpu().float().numpy(), copy=True)


#: inputs are exact small integers in float32: token j of slot i, channel c,
#: batch element b is 1 + j + 100 c + 10000 b + 100000 i (never 0: a zero
#: column is one nobody wrote)
def column(tok: int, c: int, b: int, slot: int) -> float:
    return float(1 + tok + 100 * c + 10000 * b + 100000 * slot)


def fingerprint(state: tuple[int, int, int], tok: int) -> tuple[int, int, int]:
    """The fake recurrence: (slot, count, rolling hash of the tokens)."""
    slot, t, h = state
    return slot, t + 1, (h * 31 + tok + 1) % 65521


class Mixer:
    """One linear-attention layer of a model, on one transformers
    ``LinearAttentionLayer``: ``slots`` state slots (``number_of_states``),
    of which those in ``recurrent`` have a recurrent state (the others are
    conv-only, as lfm2's short conv or qwen4_exp's extra conv slots), conv
    width ``kernel``, batch ``B``, ``C`` channels, float32."""

    def __init__(self, tf: tuple[Any, Any], kernel: int = 3, slots: int = 1, recurrent: tuple[int, ...] = (0,),
                 B: int = 1, C: int = 2):
        self.torch, cache_utils = tf
        self.layer = cache_utils.LinearAttentionLayer(number_of_states=slots)
        self.kernel, self.slots, self.recurrent, self.B, self.C = kernel, slots, recurrent, B, C
        self.toks: list[int] = []

    def record(self, keep: Any) -> None:
        self.layer.activate_past_recording(recurrent_states_to_keep=keep)

    def inputs(self, toks: list[int], slot: int) -> Any:
        a = [[[column(j, c, b, slot) for j in toks] for c in range(self.C)] for b in range(self.B)]
        return self.torch.tensor(a, dtype=self.torch.float32)

    def state_tensor(self, fp: tuple[int, int, int]) -> Any:
        return self.torch.tensor([list(fp)] * self.B, dtype=self.torch.float32)

    def live_state(self, slot: int) -> tuple[int, int, int]:
        """The state the model continues from: the layer's own (so a wrong
        restored state propagates, as in a model), zeros before the first
        forward."""
        layer = self.layer
        if not layer.has_previous_state[slot] or layer.recurrent_states[slot] is None:
            return slot, 0, 0
        s = host(layer.recurrent_states[slot])[0]
        return int(s[0]), int(s[1]), int(s[2])

    def forward(self, toks: list[int], states: str = "model") -> None:
        """A forward of ``S = len(toks)`` tokens. ``states``: ``model``
        hands what transformers' models hand (while recording and S > 1 the
        list of the states after each of the last ``min(keep, S)`` tokens,
        else the last state), ``all`` the list of all S states, ``last``
        the last state alone."""
        layer = self.layer
        for slot in range(self.slots):
            layer.update_conv_state(self.inputs(toks, slot), slot, conv_kernel_size=self.kernel)
            if slot not in self.recurrent:
                continue
            fps, fp = [], self.live_state(slot)
            for j in toks:
                fp = fingerprint(fp, j)
                fps.append(self.state_tensor(fp))
            keep = getattr(layer, "recurrent_states_to_keep", 0) or 0
            m = min(keep, len(toks)) if layer.record_past and len(toks) > 1 else 0
            if states == "all":
                m = len(toks)
            elif states == "last":
                m = 0
            layer.update_recurrent_state(fps[-m:] if m else fps[-1], slot)
        self.toks += toks

    # -- the rule ---------------------------------------------------------------

    def expected_conv(self, t: int, slot: int) -> np.ndarray:
        prefix = self.toks[:t][-self.kernel:]
        cols = [None] * (self.kernel - len(prefix)) + prefix
        return np.array([[[0.0 if j is None else column(j, c, b, slot) for j in cols] for c in range(self.C)]
                         for b in range(self.B)], np.float32)

    def conv_window(self, slot: int) -> np.ndarray:
        """The last ``kernel`` columns the layer holds, zero columns in
        front where it holds fewer (a recording layer does not pad: the
        causal conv pads with zeros itself, so that is the same window)."""
        got = host(self.layer.conv_states[slot])[..., -self.kernel:]
        pad = self.kernel - got.shape[-1]
        return np.concatenate([np.zeros((*got.shape[:-1], pad), np.float32), got], axis=-1)

    def expected_state(self, t: int, slot: int) -> tuple[int, int, int]:
        fp = (slot, 0, 0)
        for j in self.toks[:t]:
            fp = fingerprint(fp, j)
        return fp

    def crop(self, n: int) -> None:
        """``crop(-n)``, and the model's token list follows it."""
        self.layer.crop(-n)
        if n > 0:
            del self.toks[-n:]

    def length(self) -> int:
        return int(self.layer.get_seq_length())


def divergences(m: Mixer, t: int) -> list[str]:
    """Where the layer breaks the rule for "after ``t`` tokens" (empty:
    it holds exactly that)."""
    out = []
    if m.length() != t:
        out.append(f"get_seq_length() {m.length()}, expected {t}")
    for slot in range(m.slots):
        got, want = m.conv_window(slot), m.expected_conv(t, slot)
        if not np.array_equal(got, want):
            out.append(f"slot {slot}: conv window {got[0, 0].tolist()}, expected {want[0, 0].tolist()}")
        if slot in m.recurrent:
            s, w = m.live_state(slot), m.expected_state(t, slot)
            if s != w:
                out.append(f"slot {slot}: the state after {s[1]} tokens of slot {s[0]}, expected after {t} of "
                           f"slot {slot}")
    return out


def prefill_then_record(tf: Any, keep: Any, prompt: int = 5, **kw: Any) -> Mixer:
    """As ``generate`` does: the prompt without recording, then
    ``activate_past_recording(keep)``, then ``crop(0)`` (what assisted
    decoding's loop leaves after each round: the layer back at its working
    size, no history)."""
    m = Mixer(tf, **kw)
    m.forward(list(range(prompt)))
    m.record(keep)
    return m


# -- the stand-in's torch semantics the layer relies on ---------------------------


def test_torch_semantics_the_layer_relies_on(tf):
    """Basic slicing is a view, ``copy_`` writes in place (broadcasting,
    RuntimeError on shapes that do not broadcast), ``clone`` copies, a 0-d
    int counter adds and subtracts in place: the stand-in must keep these,
    or the findings below would be the stand-in's."""
    torch, _ = tf
    a = torch.zeros((1, 2, 4), dtype=torch.float32)
    view = a[..., -2:]
    view.copy_(torch.tensor([[[5.0, 6.0], [7.0, 8.0]]], dtype=torch.float32))
    assert host(a)[0].tolist() == [[0, 0, 5, 6], [0, 0, 7, 8]]
    c = a.clone()
    a.zero_()
    assert host(c)[0, 0].tolist() == [0, 0, 5, 6] and not host(a).any()
    with pytest.raises(RuntimeError):
        a.copy_(torch.zeros((1, 2, 3), dtype=torch.float32))
    n = torch.tensor(0, dtype=int)
    n.add_(3)
    n.sub_(1)
    assert int(n) == 2


# -- where the rule holds ----------------------------------------------------------


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("slots,recurrent", [(1, (0,)), (1, ()), (2, (0,)), (2, (0, 1))])
def test_rule_holds_when_every_state_is_handed_over(tf, kernel, slots, recurrent):
    """Forwards that hand over the state after every token (single-token
    forwards, or multi-token ones with the whole list) are rolled back
    exactly by one crop of any n up to the tokens since the last crop,
    whatever the conv width and number of states; the checker agrees."""
    for n in range(7):
        m = prefill_then_record(tf, keep=3, kernel=kernel, slots=slots, recurrent=recurrent)
        m.layer.crop(0)  # also gives each state slot a history list of its own (see the shared-list finding)
        m.forward([10, 11, 12], states="all")
        m.forward([13])
        m.forward([14, 15], states="all")
        m.forward([16])
        t = len(m.toks)
        assert divergences(m, t) == []
        m.crop(n)
        assert divergences(m, t - n) == [], f"crop(-{n})"
        m.forward([20, 21], states="all")  # and the model goes on from there
        assert divergences(m, t - n + 2) == []


def test_rule_holds_for_a_draft_block_no_longer_than_keep(tf):
    """A model's forward of S <= keep tokens hands S states (``min(keep,
    S)``): every crop up to S is exact."""
    for n in range(4):
        m = prefill_then_record(tf, keep=3, kernel=4)
        m.layer.crop(0)
        m.forward([10, 11, 12])
        t = len(m.toks)
        m.layer.crop(-n)
        assert divergences(m, t - n) == []


# -- findings ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_assisted_decoding_full_rejection_restores_one_token_too_far(tf, kernel, keep):
    """Finding 1 (assisted decoding's case). ``generate`` records with
    ``recurrent_states_to_keep = k`` drafted tokens and verifies ``S = k +
    1`` tokens (the last accepted token and k drafts); the model hands the
    states after the last ``min(k, S) = k`` tokens. History: [the state
    before the forward] + the k - 1 states before the last. When every draft
    is rejected, ``crop(-k)`` takes ``history[-k]``, the state before the
    forward: the recurrent state is one token behind (it lacks the accepted
    token) while the conv window is right."""
    m = prefill_then_record(tf, keep=keep, kernel=kernel)
    m.layer.crop(0)
    m.forward(list(range(10, 10 + keep + 1)))  # the verify block: k + 1 tokens
    t = len(m.toks)
    m.layer.crop(-keep)
    assert m.live_state(0) == m.expected_state(t - keep - 1, 0)  # the state before the verify block
    assert m.conv_window(0).tolist() == m.expected_conv(t - keep, 0).tolist()  # the conv is right
    assert divergences(m, t - keep) == [
        f"slot 0: the state after {t - keep - 1} tokens of slot 0, expected after {t - keep} of slot 0"]


@pytest.mark.parametrize("S,keep,n", [(2, 1, 1), (3, 1, 1), (4, 2, 2), (5, 3, 3), (4, 1, 1)])
def test_fewer_states_than_tokens_restore_the_state_before_the_forward(tf, S, keep, n):
    """Finding 1. A forward of S tokens that hands m < S states (the
    model's ``min(keep, S)`` list) records the state before the forward
    where the state after t - m belongs: ``crop(-m)`` restores the state
    after t - S, silently."""
    m = prefill_then_record(tf, keep=keep)
    m.layer.crop(0)
    m.forward(list(range(10, 10 + S)))
    t = len(m.toks)
    m.layer.crop(-n)
    assert m.live_state(0) == m.expected_state(t - S, 0)
    assert divergences(m, t - n) == [f"slot 0: the state after {t - S} tokens of slot 0, expected after {t - n} of slot 0"]


@pytest.mark.parametrize("S", [2, 3, 4])
def test_a_single_state_for_a_block_restores_the_state_before_it(tf, S):
    """Finding 1, without a list: a forward of S > 1 tokens that hands the
    last state alone (``update_recurrent_state(tensor)``, what a model does
    with recurrent_states_to_keep 0, and any prefill) records one entry,
    the state before the forward: ``crop(-1)`` restores the state S tokens
    back with the conv window 1 token back."""
    m = prefill_then_record(tf, keep=0)
    m.layer.crop(0)
    m.forward(list(range(10, 10 + S)), states="last")
    t = len(m.toks)
    m.layer.crop(-1)
    assert m.live_state(0) == m.expected_state(t - S, 0)
    assert divergences(m, t - 1) == [f"slot 0: the state after {t - S} tokens of slot 0, expected after {t - 1} of slot 0"]


def test_a_gap_in_the_history_is_crossed_silently(tf):
    """Finding 1 across forwards: keep 2, forwards of 3 then 2 tokens (the
    first hands 2 of its 3 states): crops of 1..3 are exact, ``crop(-4)``
    lands in the gap and restores the state after t - 5."""
    m = prefill_then_record(tf, keep=2)
    m.layer.crop(0)
    m.forward([10, 11, 12])
    m.forward([13, 14])
    t = len(m.toks)
    m.layer.crop(-4)
    assert divergences(m, t - 4) == [f"slot 0: the state after {t - 5} tokens of slot 0, expected after {t - 4} of slot 0"]


@pytest.mark.parametrize("case", ["beyond the list", "two crops in a row", "crop 0 then crop 1"])
def test_a_crop_beyond_the_history_raises_after_changing_the_layer(tf, case):
    """Finding 2. A crop the history cannot serve raises IndexError (list
    index out of range) after it has already moved ``get_seq_length()`` and
    cut the conv window: the layer is left half-rolled-back (conv and length
    of t - n, state of t), not unchanged. Every crop drops the history, so a
    second crop, or a crop after ``crop(0)``, is beyond it."""
    m = prefill_then_record(tf, keep=3)
    m.layer.crop(0)
    m.forward([10, 11, 12], states="all")
    t = len(m.toks)
    if case == "beyond the list":
        n = 4
    elif case == "two crops in a row":
        m.layer.crop(-1)
        t, n = t - 1, 1
    else:
        m.layer.crop(0)
        n = 1
    assert divergences(m, t) == []
    with pytest.raises(IndexError):
        m.layer.crop(-n)
    assert m.length() == t - n  # moved before the error
    assert m.live_state(0) == m.expected_state(t, 0)  # not restored
    assert any(d.startswith("get_seq_length()") for d in divergences(m, t))
    assert any(d.startswith("slot 0: conv window") for d in divergences(m, t))


def test_a_conv_only_layer_crops_beyond_its_history_silently(tf):
    """Finding 2, conv-only (lfm2's short conv has no recurrent state): no
    error at all. A crop beyond the inputs kept leaves zero columns where
    inputs were; beyond every token, ``get_seq_length()`` goes negative."""
    m = prefill_then_record(tf, keep=2, recurrent=())
    m.layer.crop(0)
    m.forward([10, 11])
    t = len(m.toks)
    m.layer.crop(-3)
    # it keeps inputs 2..4, 10, 11 (the last 3 of the prompt and the forward): after 4 tokens the window is
    # the inputs of tokens 1, 2, 3; it holds a zero column where token 1's was
    assert m.conv_window(0)[0, 0].tolist() == [0.0, column(2, 0, 0, 0), column(3, 0, 0, 0)]
    assert divergences(m, t - 3) == [
        f"slot 0: conv window [0.0, 3.0, 4.0], expected {[column(j, 0, 0, 0) for j in (1, 2, 3)]}"]
    m2 = Mixer(tf, recurrent=())
    m2.record(2)
    m2.forward([0, 1])
    m2.layer.crop(-4)
    assert m2.length() == -2


def test_two_recurrent_states_share_one_history_list(tf):
    """Finding 3. ``activate_past_recording`` builds the history with
    ``dict.fromkeys(range(number_of_states), [])``: ONE list for every
    state slot. Until the first crop replaces them, both slots' states go
    into it, and the first crop restores slot 0 from slot 1's entry (of
    another state's shape, in general)."""
    m = Mixer(tf, slots=2, recurrent=(0, 1))
    m.record(2)
    hist = m.layer.recurrent_states_history
    assert hist[0] is hist[1]
    m.forward([0, 1, 2, 3, 4])
    m.forward([5])
    t = len(m.toks)
    m.layer.crop(-1)
    assert m.live_state(0)[0] == 1  # slot 1's state in slot 0
    assert divergences(m, t - 1) == [f"slot 0: the state after {t - 1} tokens of slot 1, expected after {t - 1} of slot 0"]


def test_the_restored_state_is_the_callers_tensor(tf):
    """Finding 4 (isolation). History entries from a handed-over list are
    kept by reference; a crop makes one of them the live state, and the
    next forward's ``copy_`` writes into it: the caller's tensor of the
    state after t - 1 now reads the state after t - 1 + 1."""
    m = prefill_then_record(tf, keep=3)
    m.layer.crop(0)
    fp = m.live_state(0)
    mine = []
    for j in (10, 11, 12):
        fp = fingerprint(fp, j)
        mine.append(m.state_tensor(fp))
    m.layer.update_conv_state(m.inputs([10, 11, 12], 0), 0, conv_kernel_size=m.kernel)
    m.layer.update_recurrent_state(mine, 0)
    m.toks += [10, 11, 12]
    before = host(mine[1]).tolist()
    m.crop(1)
    assert m.layer.recurrent_states[0] is mine[1]
    m.forward([13])
    assert host(mine[1]).tolist() != before
    assert host(mine[1])[0, 1] == len(m.toks)  # it holds the live state now


# -- declared differences (refusal styles, coverage, argument checks) --------------


def test_refusals_and_crashes_before_a_crop_can_run(tf):
    """A positive count (the legacy absolute length) and a crop without
    ``activate_past_recording`` raise RuntimeError and change nothing (a
    refusal, as the spec refuses); a crop after activation but before the
    first forward raises TypeError (``-None``), also for ``crop(0)``."""
    m = prefill_then_record(tf, keep=2)
    m.forward([10])
    t = len(m.toks)
    with pytest.raises(RuntimeError, match="negative int"):
        m.layer.crop(1)
    assert divergences(m, t) == []
    m2 = Mixer(tf)
    m2.forward([0, 1, 2])
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        m2.layer.crop(-1)
    assert divergences(m2, 3) == []
    m3 = Mixer(tf)
    m3.record(2)
    with pytest.raises(TypeError):
        m3.layer.crop(0)


def test_history_and_conv_grow_without_bound_while_recording(tf):
    """``recurrent_states_to_keep`` does not bound the layer (only how many
    states a model hands over): until a crop, every forward adds to the
    history and every input stays in the conv tensor, so the coverage is
    unbounded (the spec's depth U bounds it) and so is the memory."""
    m = prefill_then_record(tf, keep=1, kernel=3)
    m.layer.crop(0)
    for j in range(10, 30):
        m.forward([j])
    assert len(m.layer.recurrent_states_history[0]) == 20
    assert m.layer.conv_states[0].shape[-1] == 3 + 20
    t = len(m.toks)
    m.layer.crop(-20)  # 20 > keep: still exact
    assert divergences(m, t - 20) == []


@pytest.mark.parametrize("keep", [None, -1, 2.5, "two"])
def test_recurrent_states_to_keep_is_not_checked(tf, keep):
    """``activate_past_recording`` takes any value; the error (if any) comes
    later, in the model. ``None`` (the default) makes
    ``Cache.get_recurrent_states_to_keep(i)`` None, which the models pass to
    ``min(None, seq_len)`` (TypeError at the next multi-token forward)."""
    _, cache_utils = tf
    m = Mixer(tf)
    m.layer.activate_past_recording(recurrent_states_to_keep=keep)
    assert m.layer.recurrent_states_to_keep == keep and m.layer.record_past
    cache = cache_utils.Cache(layers=[m.layer])
    assert cache.get_recurrent_states_to_keep(0) == keep
    if keep is None:
        with pytest.raises(TypeError):
            min(cache.get_recurrent_states_to_keep(0), 3)  # what qwen3_next / mamba2 compute


# -- the target (`--target transformers-linear`) and the search's traces ------------

FOLDER = Path(__file__).parent / "traces" / "conformance" / "transformers-linear"
TRACES = sorted(FOLDER.glob("*_[0-9][0-9].json"))


def _finding(path: Path) -> dict[str, Any]:
    doc = json.loads((FOLDER / "report.json").read_text())
    (f,) = [f for c in doc["classes"] for f in c["findings"] if Path(f["trace"]).name == path.name]
    return f


def test_every_search_trace_is_listed_and_classified():
    from kvspec.fuzz.commands.conformance import CONTRACT, FAULT, category

    assert TRACES, "no recorded transformers-linear traces"
    doc = json.loads((FOLDER / "report.json").read_text())
    listed = {Path(f["trace"]).name for c in doc["classes"] for f in c["findings"]}
    assert listed == {p.name for p in TRACES} and doc["ok"] is True
    for c in doc["classes"]:
        for f in c["findings"]:
            assert f["category"] == category(f["what"]) and f["category"] in (FAULT, CONTRACT)
    faults = [f["what"] for c in doc["classes"] for f in c["findings"] if f["category"] == FAULT]
    assert any("recurrent state differs" in w for w in faults), faults  # finding 1
    assert any("cannot be read" in w for w in faults), faults  # finding 2


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_search_trace_replays_clean_on_ours_and_diverges_on_transformers(path):
    """Each minimal trace of the search: exit 0 on this project's
    RecurrentCache; on transformers' LinearAttentionLayer (the real library,
    or its own code on the stand-in) the divergence the report names, at
    its op."""
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.targets import resolve
    from kvspec.fuzz.trace import load

    assert replay(load(path)).ok
    f = _finding(path)
    target = resolve("transformers-linear")
    for w in f["waived"]:
        target = target.waiving(w)
    with _transformers():
        result = replay(load(path), target=target)
    assert not result.ok and result.divergence.index == f["index"] and result.divergence.what == f["what"]


def test_target_without_transformers_says_so(monkeypatch):
    """No torch: the target is a usage error naming the extra, never a traceback."""
    from kvspec.fuzz.adapters.transformers import LinearAttentionAdapter
    from kvspec.fuzz.targets import TargetError

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(TargetError, match="pip install"):
        LinearAttentionAdapter({"kernel": 2, "size": 2, "depth": 1})


# -- end to end, where PyTorch is installed ------------------------------------------


def _tiny_qwen3_next(seed: int, kernel: int) -> Any:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=kernel, intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        initializer_range=0.5)  # a recurrent state that matters to the logits
    return Qwen3NextForCausalLM(cfg).eval()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch (optional extra 'transformers')")
def test_assisted_decoding_of_a_tiny_qwen3_next_is_not_greedy(monkeypatch):
    """Finding 1 end to end (real torch, transformers' own generate):
    greedy assisted decoding must give greedy decoding's tokens. A tiny
    random qwen3_next, a draft that always drafts k = 3 tokens: after every
    full rejection the linear-attention layer's recurrent state is the one
    before the verify forward (all zeros after the first round, whose verify
    forward was the prompt), and the tokens leave greedy's at the 5th. The
    control: with ``recurrent_states_to_keep = k + 1`` (the model hands one
    more state than a crop can take back) the tokens are greedy's."""
    import torch
    from transformers import cache_utils

    model, draft = _tiny_qwen3_next(0, 4), _tiny_qwen3_next(1, 3)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    prompt = torch.tensor([[5, 17, 42, 8, 23, 61, 2, 33]])
    states_after_full_rejection: list[float] = []
    crop = cache_utils.LinearAttentionLayer.crop

    def watched(self: Any, n: int) -> None:
        crop(self, n)
        if self.conv_kernel_size[0] == 4 and n == -3:  # the main model's layer, every draft rejected
            states_after_full_rejection.append(float(self.recurrent_states[0].abs().max()))

    monkeypatch.setattr(cache_utils.LinearAttentionLayer, "crop", watched)
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assisted = model.generate(prompt, assistant_model=draft, max_new_tokens=12, do_sample=False)
        assert states_after_full_rejection and states_after_full_rejection[0] == 0.0
        assert not torch.equal(greedy, assisted)
        record = cache_utils.LinearAttentionLayer.activate_past_recording
        monkeypatch.setattr(cache_utils.LinearAttentionLayer, "activate_past_recording",
                            lambda self, recurrent_states_to_keep=None: record(self, recurrent_states_to_keep + 1))
        assert torch.equal(greedy, model.generate(prompt, assistant_model=draft, max_new_tokens=12, do_sample=False))

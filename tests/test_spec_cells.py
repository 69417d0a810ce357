"""kvspec.spec.cells: every rule of the cells kind and every refusal, each refusal
shown to change nothing (semantics.md 10, docs/cells.md)."""

from __future__ import annotations

import itertools

import pytest

from kvspec.spec import cells as sc
from kvspec.spec.errors import InvalidArgumentError, StateError

ISWA = sc.CellsConfig(n_cells=8, window=3, stores=("full", "window"), n_seq=3)


def mem(config: sc.CellsConfig = ISWA) -> sc.CellsMemory:
    return sc.CellsMemory(config)


def present(m: sc.CellsMemory, store: str) -> set[tuple[int, frozenset[int], int]]:
    return {(p, s, v) for p, s, _k, v in m.observe()[store]}


def refused_unchanged(m: sc.CellsMemory, call, exc=InvalidArgumentError) -> None:
    before = m.state
    with pytest.raises(exc):
        call()
    assert m.state == before


@pytest.mark.parametrize("kwargs", [{"n_cells": 0}, {"n_seq": 0}, {"stores": ("window", "full")},
                                    {"stores": ("window",), "window": 0}, {"stores": ("full",), "window": 2},
                                    {"stores": ("full", "window"), "window": None}, {"n_cells": True}])
def test_config_refusals_name_the_field(kwargs):
    with pytest.raises(InvalidArgumentError, match="cells: "):
        sc.CellsConfig(**kwargs)


def test_decode_shares_one_cell_per_token_among_the_group():
    m = mem()
    assert m.decode((0, 1), (5, 6), 0) is True
    for store in ("full", "window"):
        assert present(m, store) == {(0, frozenset({0, 1}), 5), (1, frozenset({0, 1}), 6)}
    obs = m.observe()["full"]
    assert all(k == (v, p) for p, _s, k, v in obs)
    assert (m.pos_min(1), m.pos_max(1), m.pos_max(2)) == (0, 1, -1)


@pytest.mark.parametrize("args,match", [
    (((), (1,), 0), "seqs must be a non-empty"), (((0, 0), (1,), 0), "must not repeat"),
    (((3,), (1,), 0), "sequence id in 0..2"), (((0,), (), 0), "tokens must hold n >= 1"),
    (((0,), (1,), -1), "pos0 must be an integer >= 0"), (((0,), (1,), 5), "pos0 must be 2"),
    (((0, 1), (1,), 2), "same pos_min and pos_max"),
])
def test_decode_refusals_change_nothing(args, match):
    m = mem()
    m.decode((0,), (1, 2), 0)
    before = m.state
    with pytest.raises(InvalidArgumentError, match=match):
        m.decode(*args)
    assert m.state == before


def test_decode_without_room_returns_false_and_changes_nothing():
    m = mem(sc.CellsConfig(n_cells=3, stores=("full",), n_seq=2))
    assert m.decode((0,), (1, 2), 0)
    before = m.state
    assert m.decode((1,), (3, 4), 0) is False
    assert m.state == before
    assert m.decode((1,), (3,), 0) is True


def test_window_store_reuses_droppable_cells_and_keeps_them_as_lost():
    m = mem(sc.CellsConfig(n_cells=4, window=2, stores=("window",), n_seq=2))
    assert m.decode((0,), (10, 11, 12), 0)
    # pos_max 2: pos + 2 <= 3 -> cells 0 and 1 are droppable
    assert m.droppable() == {(0, frozenset({0}), 10), (1, frozenset({0}), 11)}
    assert sc.usable(m.state, "window") == 3
    before = m.state
    assert m.decode((0,), (13, 14, 15, 16), 3) is False  # 1 free + 2 droppable < 4
    assert m.state == before
    assert m.decode((0,), (13, 14), 3)  # 1 free: one droppable reused, the lowest
    assert present(m, "window") == {(p, frozenset({0}), 10 + p) for p in (1, 2, 3, 4)}
    assert sc.lost(m.state, 0) == {0} and sc.logical_pos_max(m.state, 0) == 4
    assert m.pos_min(0) == 1  # the window store's, as llama.cpp's iSWA memory reports it


def test_shared_cells_are_never_droppable_but_forgettable():
    m = mem(sc.CellsConfig(n_cells=8, window=2, stores=("window",), n_seq=2))
    m.decode((0, 1), (1, 2), 0)
    m.decode((0,), (3, 4), 2)
    assert (0, frozenset({0, 1}), 1) not in m.droppable()
    assert ((0, frozenset({0, 1}), 1), 0) in m.forgettable()
    m.drop("window", [((0, frozenset({0, 1}), 1), 0)])
    assert (0, frozenset({1}), 1) in present(m, "window")
    assert sc.lost(m.state, 0) == {0}


def test_drop_refuses_a_cell_that_is_not_droppable_and_changes_nothing():
    m = mem(sc.CellsConfig(n_cells=8, window=2, stores=("window",), n_seq=2))
    m.decode((0,), (1, 2, 3), 0)
    refused_unchanged(m, lambda: m.drop("window", [(2, frozenset({0}), 3)]), StateError)
    refused_unchanged(m, lambda: m.drop("window", [(0, frozenset({0}), 1), (2, frozenset({0}), 3)]), StateError)
    m.drop("window", [(0, frozenset({0}), 1)])
    assert sc.lost(m.state, 0) == {0}


def test_drop_before_decode_adopts_the_targets_choice():
    m = mem(sc.CellsConfig(n_cells=4, window=2, stores=("window",), n_seq=1))
    m.decode((0,), (10, 11, 12, 13), 0)
    # the target reused the cell of position 2, not 0 (lowest first is the spec's own choice)
    m.drop("window", [(2, frozenset({0}), 12)])
    assert m.decode((0,), (14,), 4)
    assert sc.lost(m.state, 0) == {2}


def test_seq_rm_frees_a_cell_exactly_when_its_set_is_empty():
    m = mem()
    m.decode((0, 1), (1, 2, 3), 0)
    assert m.seq_rm(0, 1, 2) is True  # a middle removal: a hole for 0
    assert present(m, "full") == {(0, frozenset({0, 1}), 1), (1, frozenset({1}), 2), (2, frozenset({0, 1}), 3)}
    assert (m.pos_min(0), m.pos_max(0)) == (0, 2)  # holes allowed (Decision 1)
    assert m.seq_rm(1, 1, 2) is True
    assert (1, frozenset(), 2) not in present(m, "full") and len(present(m, "full")) == 2
    assert m.seq_rm(-1, -5, -1) is True
    assert present(m, "full") == set() == present(m, "window")


def test_seq_rm_reads_negative_bounds_as_llama_h_says():
    m = mem()
    m.decode((0,), (1, 2, 3), 0)
    assert m.seq_rm(0, -3, 2)
    assert {p for p, *_ in m.observe()["full"]} == {2}
    assert m.seq_rm(0, 0, -7)
    assert m.observe()["full"] == []


def _evicted(window: int = 2) -> sc.CellsMemory:
    """Sequence 0 at positions 0..5, the window store has dropped 0 and 1."""
    m = mem(sc.CellsConfig(n_cells=16, window=window, stores=("full", "window"), n_seq=2))
    m.decode((0,), (10, 11, 12, 13, 14, 15), 0)
    m.state = sc.drop(m.state, "window", [(0, frozenset({0}), 10), (1, frozenset({0}), 11)])
    return m


def test_windowed_seq_rm_refused_when_a_lost_position_enters_the_next_window():
    m = _evicted()
    assert sc.lost(m.state, 0) == {0, 1}
    before = m.state
    # after removing [3, inf) the next decode is at 3 and sees 2 and 1 (w=2: 3 - q < 2 -> q = 2): q=1 not seen
    # removing [2, inf): next decode at 2 sees q = 1, which is lost -> refused
    assert m.seq_rm(0, 2, None) is False
    assert m.state == before
    assert m.seq_rm(0, 2, 4) is True  # a middle removal keeps pos_max 5: lost 0,1 stay outside
    assert m.seq_rm(0, 3, None) is False  # new logical pos_max 1 ... lost 1 itself is the top
    assert m.seq_rm(0, 0, None) is True  # the whole sequence: always allowed
    assert m.observe() == {"full": [], "window": []}


def test_windowed_seq_rm_refusal_over_every_small_case_matches_the_rule():
    for p0, p1 in itertools.product(range(-1, 7), [None, *range(8)]):
        m = _evicted()
        ok = m.seq_rm(0, p0, p1)
        left = sc.logical_positions(m.state, 0) if ok else frozenset(
            q for q in range(6) if not sc.in_range(q, p0, p1))
        top = max(left, default=-1)
        partial = not (max(p0, 0) == 0 and p1 is None)
        breach = partial and any(q > top + 1 - 2 for q in {0, 1} & left) and left != frozenset(range(6))
        assert ok == (not breach), (p0, p1)


def test_seq_rm_on_a_full_store_alone_is_never_refused():
    m = mem(sc.CellsConfig(n_cells=4, stores=("full",), n_seq=1))
    m.decode((0,), (1, 2, 3), 0)
    assert m.seq_rm(0, 1, None) is True


def test_seq_cp_shares_cells_and_refuses_a_collision():
    m = mem()
    m.decode((0,), (1, 2, 3), 0)
    m.seq_cp(0, 1, 0, 2)
    assert present(m, "full") == {(0, frozenset({0, 1}), 1), (1, frozenset({0, 1}), 2), (2, frozenset({0}), 3)}
    assert len(m.observe()["full"]) == 3  # no copy
    m.seq_cp(0, 1, 0, 2)  # again: already shared, nothing new
    m.decode((2,), (9, 9, 9), 0)
    refused_unchanged(m, lambda: m.seq_cp(0, 2, 0, None))
    before = m.state
    m.seq_cp(1, 1, 0, None)
    assert m.state == before


def test_seq_cp_gives_dst_the_lost_positions_too():
    m = _evicted()
    m.seq_cp(0, 1, -1, -1)
    assert sc.lost(m.state, 1) == {0, 1} and sc.logical_pos_max(m.state, 1) == 5


def test_seq_keep_frees_cells_of_other_sequences():
    m = mem()
    m.decode((0, 1), (1,), 0)
    m.decode((2,), (7,), 0)
    m.seq_keep(1)
    assert present(m, "full") == {(0, frozenset({1}), 1)}


def test_seq_add_moves_a_shared_cell_for_every_holder_and_frees_below_zero():
    m = mem()
    m.decode((0, 1), (1, 2, 3), 0)
    m.seq_add(0, 1, None, 4)
    assert present(m, "full") == {(0, frozenset({0, 1}), 1), (5, frozenset({0, 1}), 2), (6, frozenset({0, 1}), 3)}
    assert m.pos_max(1) == 6  # sequence 1 moved too: a cell has one position (hazard H1)
    m.seq_add(0, 0, 6, -5)
    assert present(m, "full") == {(0, frozenset({0, 1}), 2), (6, frozenset({0, 1}), 3)}  # 0 - 5 < 0: freed
    assert all(k == (v, p) for p, _s, k, v in m.observe()["window"])


def test_seq_add_collision_and_bad_arguments_are_refused():
    m = mem()
    m.decode((0,), (1, 2, 3, 4), 0)
    refused_unchanged(m, lambda: m.seq_add(0, 2, None, -1))
    refused_unchanged(m, lambda: m.seq_add(0, 0, None, 1.5))
    refused_unchanged(m, lambda: m.seq_add(5, 0, None, 1))
    refused_unchanged(m, lambda: m.seq_add(0, "a", None, 1))
    before = m.state
    m.seq_add(0, 0, None, 0)
    m.seq_add(0, 3, 3, 9)
    assert m.state == before
    m.seq_rm(0, 1, 2)
    m.seq_add(0, 2, None, -1)  # the context shift: remove, then move the tail down
    assert {p for p, *_ in m.observe()["full"]} == {0, 1, 2}


def test_shifts_compose():
    for d1, d2 in itertools.product(range(-3, 4), repeat=2):
        a, b = mem(), mem()
        for x in (a, b):
            x.decode((0,), (1, 2, 3), 0)
            x.seq_rm(0, 0, 1)  # positions 1, 2 remain
        try:
            a.seq_add(0, 0, None, d1)
            a.seq_add(0, 0, None, d2)
        except InvalidArgumentError:
            continue
        b.seq_add(0, 0, None, d1 + d2)
        if 1 + d1 >= 0 and 1 + d1 + d2 >= 0:  # no cell went below 0 on the way
            assert a.state == b.state, (d1, d2)


def test_seq_div():
    m = mem()
    m.decode((0,), (1, 2, 3, 4), 0)
    refused_unchanged(m, lambda: m.seq_div(0, 0, None, 0))
    refused_unchanged(m, lambda: m.seq_div(0, 0, None, 2))  # 0, 1 -> 0, 0
    m.seq_rm(0, 1, 2)
    m.seq_rm(0, 3, 4)
    m.seq_div(0, 0, None, 2)  # 0, 2 -> 0, 1
    assert {p for p, *_ in m.observe()["full"]} == {0, 1}


def test_save_of_a_window_store_keeps_only_the_live_window_and_restore_rebuilds_lost_cells():
    m = _evicted(window=2)
    snap = m.save(0)
    assert snap.store("full") == tuple((p, 10 + p) for p in range(6))
    assert snap.store("window") == ((4, 14), (5, 15))  # pos_max - pos < 2
    assert m.observe_snapshot(snap)["window"] == [(4, (14, 4), 14), (5, (15, 5), 15)]
    assert m.restore(snap, 1) is True
    assert sc.logical_positions(m.state, 1) == frozenset(range(6))
    assert sc.lost(m.state, 1) == {0, 1, 2, 3}
    assert (m.pos_min(1), m.pos_max(1)) == (4, 5)
    assert m.decode((1,), (16,), 6)


def test_restore_into_the_same_sequence_and_refusals():
    m = mem(sc.CellsConfig(n_cells=4, stores=("full",), n_seq=2))
    m.decode((0,), (1, 2), 0)
    snap = m.save(0)
    m.decode((0,), (3,), 2)
    assert m.restore(snap, 0) and present(m, "full") == {(0, frozenset({0}), 1), (1, frozenset({0}), 2)}
    m.decode((1,), (7, 8), 0)
    big = m.save(1)
    m.decode((0,), (3,), 2)
    before = m.state
    assert m.restore(sc.Snapshot(("full",), (((0, 1), (1, 2), (2, 3)),)), 1) is False  # 1 + 2 free < 3
    assert m.state == before  # dst not cleared either (Decision 3)
    refused_unchanged(m, lambda: m.restore(sc.Snapshot(("full", "window"), ((), ())), 1))
    refused_unchanged(m, lambda: m.restore(sc.Snapshot(("full",), (((0, 1), (0, 2)),)), 1))
    assert m.restore(big, 1)


def test_clear():
    m = mem()
    m.decode((0, 1, 2), (1, 2), 0)
    m.clear()
    assert m.observe() == {"full": [], "window": []} and m.pos_max(0) == -1


def test_full_store_mirrors_window_plus_lost():
    """With a full store: every sequence's full positions = present window positions + lost ones."""
    m = _evicted()
    m.seq_cp(0, 1, 0, None)
    m.seq_add(1, 0, None, 3)
    for s in range(2):
        full = {p for p, ss, *_ in m.observe()["full"] if s in ss}
        win = {p for p, ss, *_ in m.observe()["window"] if s in ss}
        assert full == win | sc.lost(m.state, s)


def test_window_breaches_hazard_from_a_partial_copy():
    """A partial seq_cp can put a lost position into dst's next window (hazard H2): reported, not refused."""
    m = _evicted()
    m.seq_cp(0, 1, 0, 2)  # dst: lost 0 and 1, nothing present; its next decode (at 2) sees 1
    assert sc.window_breaches(m.state, 1) == (1,)
    assert sc.window_breaches(m.state, 0) == ()


def _invariants(m: sc.CellsMemory) -> None:
    st = m.state
    for name in st.config.stores:
        seen = set()
        for c in st.store(name):
            assert c.seqs and c.pos >= 0
            for s in c.seqs:
                assert (s, c.pos) not in seen, (name, s, c.pos)
                seen.add((s, c.pos))
        assert len(st.present(name)) <= st.config.n_cells
    if st.config.stores == ("full", "window"):
        full = {(c.pos, c.seqs, c.token) for c in st.store("full")}
        window = {(c.pos, c.seqs, c.token) for c in st.store("window") if not c.lost}
        for s in range(st.config.n_seq):
            f = {p for p, ss, _ in full if s in ss}
            assert f == {p for p, ss, _ in window if s in ss} | sc.lost(st, s)


def test_random_op_sequences_keep_the_invariants_and_refusals_change_nothing():
    import random

    rng = random.Random(49)
    layouts = [sc.CellsConfig(6, None, ("full",), 3), sc.CellsConfig(8, 2, ("full", "window"), 3),
               sc.CellsConfig(5, 3, ("window",), 2)]
    counts = {"refused": 0, "false": 0, "done": 0}
    for run in range(120):
        m = mem(layouts[run % 3])
        n = m.config.n_seq
        for _ in range(30):
            s = rng.randrange(n)
            p0, p1 = rng.randrange(-1, 8), rng.choice([None, -1, *range(9)])
            op = rng.choice(["decode", "decode", "decode", "rm", "cp", "keep", "add", "div", "save", "clear"])
            before = m.state
            try:
                if op == "decode":
                    group = tuple(sorted(rng.sample(range(n), rng.randint(1, 2))))
                    ok = m.decode(group, tuple(rng.randrange(50) for _ in range(rng.randint(1, 3))),
                                  sc.logical_pos_max(m.state, group[0]) + 1)
                elif op == "rm":
                    ok = m.seq_rm(rng.choice([s, -1]), p0, p1)
                elif op == "cp":
                    ok = m.seq_cp(s, rng.randrange(n), p0, p1)
                elif op == "keep":
                    ok = m.seq_keep(s)
                elif op == "add":
                    ok = m.seq_add(s, p0, p1, rng.randint(-4, 4))
                elif op == "div":
                    ok = m.seq_div(s, p0, p1, rng.randint(1, 3))
                elif op == "save":
                    snap = m.save(s)
                    ok = m.restore(snap, rng.randrange(n))
                else:
                    ok = m.clear()
            except InvalidArgumentError:
                assert m.state == before
                counts["refused"] += 1
                continue
            if ok is False:
                assert m.state == before
                counts["false"] += 1
            else:
                counts["done"] += 1
            _invariants(m)
    assert min(counts.values()) > 20, counts


# -- a group validated before the drops; a smaller window store; restore reuses droppable cells -------------


def test_decode_validates_the_group_before_the_targets_drops():
    # llama-batch.cpp validates the batch (coupled sequences agree on pos_min/pos_max) before find_slot reuses
    # a cell: a drop of another group member's old cell must not make the spec refuse the decode
    m = sc.CellsMemory(n_cells=6, window=2, stores=("window",), n_seq=2)
    m.decode((0,), (1, 2, 3), 0)
    m.decode((1,), (4, 5, 6), 0)
    assert m.decode((0, 1), (7,), 3, drops=[(0, frozenset({1}), 4)])
    assert sc.lost(m.state, 1) == {0} and sc.lost(m.state, 0) == frozenset()
    assert (3, frozenset({0, 1}), 7) in present(m, "window")


def test_decode_drops_are_checked_on_the_state_before_the_decode():
    m = sc.CellsMemory(n_cells=3, window=2, stores=("window",), n_seq=1)
    m.decode((0,), (1, 2, 3), 0)
    # position 2 is inside the window of the next token (3 - 2 < 2): not droppable
    refused_unchanged(m, lambda: m.decode((0,), (4,), 3, drops=[(2, frozenset({0}), 3)]), StateError)
    # a bad group is refused before any drop is looked at
    refused_unchanged(m, lambda: m.decode((0,), (4,), 5, drops=[(0, frozenset({0}), 1)]))


@pytest.mark.parametrize("kwargs", [{"window_cells": 0}, {"window_cells": 9}, {"window_cells": "4"},
                                    {"stores": ("full",), "window": None, "window_cells": 4}])
def test_window_cells_refusals_name_the_field(kwargs):
    base = {"n_cells": 8, "window": 2, "stores": ("full", "window"), "n_seq": 2, **kwargs}
    with pytest.raises(InvalidArgumentError, match="window_cells"):
        sc.CellsConfig(**base)


def test_a_smaller_window_store_reuses_cells_while_the_full_store_has_room():
    cfg = sc.CellsConfig(n_cells=8, window=2, stores=("full", "window"), n_seq=2, window_cells=3)
    assert cfg.size("full") == 8 and cfg.size("window") == 3
    assert sc.CellsConfig(n_cells=5).window_cells == 5
    m = mem(cfg)
    assert m.decode((0,), (1, 2, 3), 0)
    assert sc.free_cells(m.state, "window") == 0 and sc.free_cells(m.state, "full") == 5
    assert m.decode((0,), (4,), 3)  # the window store reuses position 0 (3 + 1 - 0 >= 2)
    assert sc.lost(m.state, 0) == {0} and len(m.state.present("full")) == 4
    # a tail removal that brings the lost position back into the next window: refused, as at any size
    before = m.state
    assert m.seq_rm(0, 1, None) is False and m.state == before
    # the window store has no room for two more tokens out of one sequence's reach: no slot
    m.decode((1,), (5,), 0)
    assert m.decode((1,), (6, 7, 8), 1) is False


def test_restore_reuses_droppable_window_cells_as_a_decode_does():
    # llama.cpp's state_read_meta clears dst, then find_slot: droppable cells of other sequences may be reused
    cfg = sc.CellsConfig(n_cells=8, window=2, stores=("full", "window"), n_seq=2, window_cells=4)
    # a restore that needs more than the free cells: droppable cells of another sequence are reused
    m = mem(cfg)
    m.decode((0,), (1, 2, 3, 4), 0)  # window: 0..3 of sequence 0, droppable 0..2 (5 - pos >= 2)
    two = sc.Snapshot(("full", "window"), (((0, 9), (1, 9)), ((0, 9), (1, 9))))
    assert sc.usable(m.state, "window") == 3
    assert m.restore(two, 1) is True
    assert sc.lost(m.state, 0) == {0, 1}
    assert {(p, s) for p, s, _ in present(m, "window")} == {(2, frozenset({0})), (3, frozenset({0})),
                                                           (0, frozenset({1})), (1, frozenset({1}))}
    # the target's choice is adopted (checked droppable on the cleared state), and a wrong one is refused
    m = mem(cfg)
    m.decode((0,), (1, 2, 3, 4), 0)
    assert m.restore(two, 1, drops=[(2, frozenset({0}), 3), (0, frozenset({0}), 1)])
    assert sc.lost(m.state, 0) == {0, 2}
    m = mem(cfg)
    m.decode((0,), (1, 2, 3, 4), 0)
    refused_unchanged(m, lambda: m.restore(two, 1, drops=[(3, frozenset({0}), 4)]), StateError)
    # no room even with reuse: False, nothing changes (dst not cleared either)
    three = sc.Snapshot(("full", "window"), (((0, 9), (1, 9), (2, 9), (3, 9)),) * 2)
    m.decode((1,), (8,), 0)
    before = m.state
    assert m.restore(three, 1) is False and m.state == before


# -- two pos_max notions: the reported one (present cells of the window store) and the logical one --------------


def _droppable_by_definition(st: sc.CellsState, top) -> frozenset:
    """Present window cells held by one sequence h, out of the window of
    ``top(h)``."""
    w = st.config.window
    return frozenset(c.key for c in st.present("window") if len(c.seqs) == 1
                     and sc.out_of_window(c.pos, max(top(next(iter(c.seqs))), c.pos), w))


def test_droppable_is_out_of_the_window_of_the_holders_logical_pos_max_over_random_ops():
    """Over random op sequences: droppable(state) == the single-holder
    present window cells out of the window of the holder's LOGICAL pos_max;
    and the states where the reported pos_max would answer otherwise are
    reached (so a droppable reading the reported one fails here)."""
    import random

    rng = random.Random(4906)
    layouts = [sc.CellsConfig(8, 2, ("full", "window"), 3), sc.CellsConfig(6, 3, ("window",), 2),
               sc.CellsConfig(8, 1, ("full", "window"), 2, window_cells=3), sc.CellsConfig(8, 2, ("full", "window"), 2,
                                                                                          window_cells=4)]
    differs = checked = 0
    for run in range(160):
        m = mem(layouts[run % len(layouts)])
        n = m.config.n_seq
        for _ in range(30):
            s = rng.randrange(n)
            p0, p1 = rng.randrange(-1, 8), rng.choice([None, -1, *range(9)])
            op = rng.choice(["decode", "decode", "decode", "rm", "cp", "add", "add", "save"])
            try:
                if op == "decode":
                    m.decode((s,), tuple(rng.randrange(9) for _ in range(rng.randint(1, 3))),
                             sc.logical_pos_max(m.state, s) + 1)
                elif op == "rm":
                    m.seq_rm(s, p0, p1)
                elif op == "cp":
                    m.seq_cp(s, rng.randrange(n), p0, p1)
                elif op == "add":
                    m.seq_add(s, p0, p1, rng.randint(-4, 6))
                else:
                    m.restore(m.save(s), rng.randrange(n))
            except InvalidArgumentError:
                continue
            st = m.state
            logical = _droppable_by_definition(st, lambda h, st=st: sc.logical_pos_max(st, h))
            assert sc.droppable(st) == logical, (run, st)
            checked += 1
            differs += logical != _droppable_by_definition(st, lambda h, st=st: sc.pos_max(st, h))
    assert checked > 2000 and differs > 5, (checked, differs)


def test_every_consumer_of_pos_max_reads_its_own_notion_where_the_two_differ():
    """w = 1, a window store of 2 cells: sequence 1's two tokens reuse both
    of sequence 0's window cells, so sequence 0 reports pos_max -1 (no
    present window cell) while its logical pos_max is 1."""
    m = mem(sc.CellsConfig(6, 1, ("full", "window"), 2, window_cells=2))
    assert m.decode((0,), (1, 2), 0) and m.decode((1,), (3, 4), 0)
    st = m.state
    assert sc.lost(st, 0) == {0, 1}
    # the reported notion: pos_min/pos_max (the window store), the coupled-group check, save's window part
    assert (sc.pos_min(st, 0), sc.pos_max(st, 0)) == (-1, -1) and sc.pos_max(st, 1) == 1
    refused_unchanged(m, lambda: m.decode((0, 1), (9,), 2))  # uncoupled by the reported bounds
    assert m.save(0).store("window") == () and [p for p, _ in m.save(0).store("full")] == [0, 1]
    # the logical notion: where a decode continues, the window rule of seq_rm, droppable
    assert sc.logical_pos_max(st, 0) == 1
    refused_unchanged(m, lambda: m.decode((0,), (9,), 0))  # reported + 1: refused
    ok, _ = sc.decode(st, (0,), (9,), 2)
    assert ok
    ok, after = sc.seq_rm(st, 0, 1, None)  # logical: the next window (position 1) holds no lost position
    assert ok and sc.logical_pos_max(after, 0) == 0
    assert sc.droppable(st) == _droppable_by_definition(st, lambda h: sc.logical_pos_max(st, h))
    # the same question on a wider window, where the notions give other answers (a shift of lost cells only)
    m = mem(sc.CellsConfig(8, 2, ("full", "window"), 2, window_cells=4))
    assert m.decode((0,), (1, 2, 3, 4), 0) and m.decode((0,), (5, 6), 4)
    assert sc.lost(m.state, 0) == {0, 1}
    m.seq_add(0, 0, 2, 10)  # the lost positions move above the present ones
    st = m.state
    assert sc.pos_max(st, 0) == 5 and sc.logical_pos_max(st, 0) == 11
    assert (5, frozenset({0}), 6) in sc.droppable(st)  # out of the window of 11, not of 5
    refused_unchanged(m, lambda: m.decode((0,), (9,), 6))
    assert m.decode((0,), (9,), 12)

"""Pipeline schedules as data (unit tier, no MPI): every list is checked by reading it
and by running it in the simulator, and the simulated bubble is the papers' formula."""

from collections import Counter
from fractions import Fraction

import pytest

from mpitrain import cost
from mpitrain import schedules as pl


def shapes(name):
    """Every (p, m, v) the schedule takes for p <= 8 stages, m <= 16 micro-batches, v <= 2 chunks."""
    return [(p, m, v) for p in range(1, 9) for m in range(1, 17) for v in (1, 2)
            if (v == 1 or (name == "interleaved" and p > 1)) and (name != "interleaved" or m % p == 0)]


def ranks_of(name, p, m, v=1):
    return [pl.schedule(name, p, m, r, v) for r in range(p)]


@pytest.mark.parametrize("name", pl.SCHEDULES)
def test_lists_are_consistent(name):
    for p, m, v in shapes(name):
        lists_are_consistent(name, p, m, v)


def lists_are_consistent(name, p, m, v):
    """Read every rank's list: each forward before its backward, each weight pass after
    its input gradient, every pass once, every send matched by one receive; then run it."""
    ranks = ranks_of(name, p, m, v)
    sends, recvs = Counter(), Counter()
    for r, actions in enumerate(ranks):
        seen = []
        for a in actions:
            key = (a.mb, a.chunk)
            if isinstance(a, (pl.Backward, pl.BackwardInput)):
                assert ("F", key) in seen, f"rank {r}: {a} before its forward"
            if isinstance(a, pl.BackwardWeight):
                assert ("I", key) in seen, f"rank {r}: {a} before its input gradient"
            if isinstance(a, (pl.SendActivation, pl.SendGrad)):
                step = 1 if isinstance(a, pl.SendActivation) else -1
                sends[(r, *pl.neighbour(p, v, r, a.chunk, step), a.mb, type(a).__name__[4:])] += 1
            if isinstance(a, (pl.RecvActivation, pl.RecvGrad)):
                step = -1 if isinstance(a, pl.RecvActivation) else 1
                src, chunk = pl.neighbour(p, v, r, a.chunk, step)
                recvs[(src, r, a.chunk, a.mb, type(a).__name__[4:])] += 1
            seen.append((a.code, key))
        # every micro-batch of every chunk runs forward and its whole backward exactly once
        computed = Counter(code for code, _ in seen if code in "FBIW")
        assert computed["F"] == m * v
        assert computed["B"] + computed["I"] == m * v and computed["W"] == computed["I"]
    assert sends == recvs and all(n == 1 for n in sends.values())
    pl.simulate(ranks, p, v)  # finishes: no rank waits on itself, messages meet their receives


@pytest.mark.parametrize("name", pl.SCHEDULES)
def test_simulated_bubble_is_the_formula(name):
    for p, m, v in shapes(name):
        simulated_bubble_is_the_formula(name, p, m, v)


def simulated_bubble_is_the_formula(name, p, m, v):
    ranks = ranks_of(name, p, m, v)
    one = Fraction(1)
    unit = pl.simulate(ranks, p, v, pl.costs_of(one, one, one, v))
    for r in range(p):
        where = f"{name} p={p} m={m} v={v} rank {r}"
        if name in ("gpipe", "1f1b"):  # (p-1)/(m+p-1) of the step
            assert unit.bubble_fraction(r) == cost.bubble_fraction(name, p, m, v, one, one, one), where
            assert unit.bubble_fraction(r) == Fraction(p - 1, m + p - 1), where
        elif name == "interleaved":  # (p-1)/(v m) of the work
            assert unit.bubble_ratio(r) == cost.pipeline_idle(name, p, m, v, one, one, one) / (3 * m), where
            assert unit.bubble_ratio(r) == Fraction(p - 1, v * m), where
        else:  # ZB-H1: weight passes fill the warm-up, as many as there are micro-batches after the first
            for F, B, W in [(1, 1, 1), (2, 1, 1), (1, 1, Fraction(1, 2)), (1, 2, 1)]:
                sim = pl.simulate(ranks, p, v, pl.costs_of(F, B, W))
                assert sim.idle[r] == (p - 1) * (F + B) - (min(m, p) - 1) * W == cost.pipeline_idle(
                    name, p, m, v, F, B, W), where
            assert p == 1 or unit.idle[r] < cost.pipeline_idle("1f1b", p, m), where  # below 1F1B


@pytest.mark.parametrize("p", range(1, 9))
def test_peak_micro_batches_held(p):
    for m in range(1, 17):
        gpipe = pl.simulate(ranks_of("gpipe", p, m), p)
        one = pl.simulate(ranks_of("1f1b", p, m), p)
        zb = pl.simulate(ranks_of("zb-h1", p, m), p)
        for r in range(p):
            assert gpipe.held[r] == m == cost.micro_batches_held("gpipe", p, m, r)
            assert one.held[r] == min(m, p - r) == cost.micro_batches_held("1f1b", p, m, r), (p, m, r)
            assert zb.held[r] <= cost.micro_batches_held("zb-h1", p, m, r), (p, m, r)


@pytest.mark.parametrize("p", range(2, 9))
def test_interleaved_holds_its_warm_up_and_one(p):
    for m in range(p, 17, p):
        sim = pl.simulate(ranks_of("interleaved", p, m, 2), p, 2)
        assert sim.held == [cost.micro_batches_held("interleaved", p, m, r, 2) for r in range(p)]


def test_zero_bubble_and_interleaving_beat_1f1b():
    p, m = 4, 8
    one = pl.simulate(ranks_of("1f1b", p, m), p).idle[0]
    assert pl.simulate(ranks_of("zb-h1", p, m), p).idle[0] < one
    assert pl.simulate(ranks_of("interleaved", p, m, 2), p, 2).idle[0] < one


def test_1f1b_of_one_stage_is_gradient_accumulation():
    assert [str(a) for a in pl.schedule("1f1b", 1, 3, 0)] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert [str(a) for a in pl.schedule("1f1b", 2, 2, 1)] == ["ra0", "F0", "B0", "sg0", "ra1", "F1", "B1", "sg1"]


def test_the_simulator_refuses_broken_lists():
    good = ranks_of("1f1b", 2, 2)
    swapped = [list(good[0]), list(good[1])]
    i, j = swapped[1].index(pl.Forward(0)), swapped[1].index(pl.Backward(0))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ValueError, match="before its forward"):
        pl.simulate(swapped, 2)
    # rank 1 posts its receives in the other order than rank 0 sends
    crossed = [good[0], [pl.RecvActivation(1), pl.RecvActivation(0)] + [a for a in good[1] if a.code != "ra"]]
    with pytest.raises(ValueError, match="carries micro-batch 1"):
        pl.simulate(crossed, 2)
    waiting = [[pl.RecvGrad(0), pl.Forward(0), pl.Backward(0)], [pl.RecvActivation(0), pl.Forward(0)]]
    with pytest.raises(ValueError, match="wait on each other"):
        pl.simulate(waiting, 2)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        pl.schedule("interleaved", 4, 6, 0, v=2)
    with pytest.raises(ValueError, match="interleaved schedule"):
        pl.schedule("1f1b", 2, 4, 0, v=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pl.schedule("pipedream", 2, 4, 0)

"""Note [optimizer steps run, not replayed]: where a recorded call's optimizer steps
begin, and a part of a graph with its inline tensors numbered among themselves."""

from __future__ import annotations

import pytest

from djinn.frontend.replay_key import Step
from djinn.frontend.replay_steps import optimizer_cut, outer_steps, own_inline


def _step(start: int, end: int | None, odd: bool = False, opt: object = None) -> Step:
    step = Step(object() if opt is None else opt, start, odd)
    step.end = end
    return step


@pytest.mark.parametrize(
    ("count", "steps", "cut"),
    [
        (10, [_step(6, 10)], 6),  # one step ends the call
        (10, [_step(4, 7), _step(7, 10)], 4),  # two, in turn
        (10, [], None),  # no step
        (10, [_step(6, 9)], None),  # an op after it
        (10, [_step(3, 6), _step(7, 10)], None),  # an op between two
        (10, [_step(4, 10), _step(5, 8)], None),  # one inside another
        (10, [_step(6, 10, odd=True)], None),  # a closure, or another thread
        (10, [_step(6, None)], None),  # it raised: never ended
        (10, [_step(0, 10)], None),  # nothing before it to replay
        (10, [_step(10, 10)], None),  # it captured nothing (its parameters are local)
    ],
)
def test_the_cut_is_where_the_steps_that_end_the_call_begin(count, steps, cut):
    assert optimizer_cut(count, steps) == cut


def test_a_part_of_a_graph_numbers_its_inline_tensors_among_themselves():
    inline = ["a", "b", "c", "d"]
    nodes = [
        {"op": "x", "args": [{"$t": 2, "desc": {}}, [{"$v": 0}, {"$t": 2, "desc": {}}]]},
        {"op": "y", "args": [], "kwargs": {"w": {"$t": 0, "desc": {}}}, "rng": 3},
    ]
    got, tensors = own_inline(nodes, inline)
    assert got[0]["args"][0]["$t"] == 0 and got[0]["args"][1][1]["$t"] == 0
    assert got[1]["kwargs"]["w"]["$t"] == 1 and got[1]["rng"] == 2
    assert tensors == ["c", "a", "d"]
    assert nodes[0]["args"][0]["$t"] == 2  # the graph's own nodes are left as they were


def test_a_step_run_inside_its_own_optimizers_step_is_not_a_step_of_its_own():
    """A subclass's ``step()`` calling ``super().step(closure)``: both are hooked, the
    inner one with an argument (odd)."""
    opt, other = object(), object()
    outer, inner = _step(6, 10, opt=opt), _step(6, 10, odd=True, opt=opt)
    assert outer_steps([outer, inner]) == [outer]
    assert optimizer_cut(10, outer_steps([outer, inner])) == 6
    two = [_step(4, 7, opt=opt), _step(7, 10, opt=other)]
    assert outer_steps(two) == two  # in turn, not inside one another
    again = [_step(4, 7, opt=opt), _step(7, 10, opt=opt)]
    assert outer_steps(again) == again  # the same optimizer stepped twice

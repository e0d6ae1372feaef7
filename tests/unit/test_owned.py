"""The order shared by the records bounded per owner (pdserve/owned.py)."""

from pdserve.owned import OwnedOrder


def test_past_the_bound_the_owner_keeping_the_most_loses_its_oldest():
    order: OwnedOrder[str] = OrderFixture.make([("q1", "quiet"), ("b1", "busy"), ("b2", "busy"), ("b3", "busy")])
    assert order.trim(3) == ["b1"]
    assert list(order) == ["q1", "b2", "b3"] and order.count("busy") == 2
    order.add("q2", "quiet")  # now two each: of equals, the one whose oldest key is the oldest gives way
    assert order.trim(3) == ["q1"]
    assert order.trim(3) == []


def test_owners_keeping_as_many_give_way_oldest_first_and_a_lone_owner_keeps_the_whole_bound():
    order = OrderFixture.make([("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b")])
    assert order.trim(2) == ["a1", "b1"]
    # Owners keeping one each take turns, as one LRU would: a new owner's key is not the one dropped.
    ones = OrderFixture.make([("x", "ox"), ("y", "oy"), ("z", "oz")])
    ones.add("w", "ow")
    assert ones.trim(3) == ["x"] and "w" in ones
    lone = OrderFixture.make([(f"k{i}", "one") for i in range(5)])
    assert lone.trim(5) == [] and len(lone) == 5


def test_adding_again_moves_a_key_to_the_end_and_under_its_new_owner():
    order = OrderFixture.make([("x", "a"), ("y", "a")])
    order.add("x", "b")
    assert list(order) == ["y", "x"] and order.owner("x") == "b" and order.owners() == ["a", "b"]
    assert order.discard("x") and not order.discard("x")
    assert order.owners() == ["a"] and "x" not in order and order.count("b") == 0


def test_an_owners_own_bound_takes_its_oldest_only():
    order = OrderFixture.make([("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a")])
    assert order.trim_owner("a", 1) == ["a1", "a2"]
    assert list(order) == ["b1", "a3"]
    assert order.trim_owner("nobody", 0) == [] and order.trim(0) == ["b1", "a3"] and len(order) == 0


def test_weighted_bounds_take_from_the_owner_heaviest():
    order: OwnedOrder[str] = OwnedOrder()
    for key, owner, weight in [("a1", "a", 10), ("b1", "b", 1), ("b2", "b", 1), ("b3", "b", 1)]:
        order.add(key, owner, weight)
    assert order.weight() == 13 and order.weight("a") == 10 and order.weight("nobody") == 0
    # By count, "b" keeps the most; by weight "a" does.
    assert order.trim(3, weighted=True) == ["a1"] and order.weight() == 3
    # One key alone past the bound: its owner is the heaviest and loses it, not the others theirs.
    order.add("a2", "a", 50)
    assert order.trim(20, weighted=True) == ["a2"] and list(order) == ["b1", "b2", "b3"]
    assert order.trim_owner("b", 1, weighted=True) == ["b1", "b2"] and order.weight("b") == 1
    assert order.trim_owner("b", 0, weighted=True) == ["b3"] and order.weight() == 0 and order.owners() == []
    # Adding a key again replaces its weight.
    order.add("c", "c", 4)
    order.add("c", "c", 7)
    assert order.weight() == order.weight("c") == 7 and order.count("c") == 1


class OrderFixture:
    @staticmethod
    def make(pairs: list[tuple[str, str]]) -> OwnedOrder[str]:
        order: OwnedOrder[str] = OwnedOrder()
        for key, owner in pairs:
            order.add(key, owner)
        return order

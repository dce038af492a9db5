"""Property: the prefix index never reports more than was inserted and not evicted, and
behaves as one plain LRU list per replica."""

from __future__ import annotations

from collections import OrderedDict
from itertools import takewhile

from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.prefix.index import PrefixIndex

_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "evict", "remove"]),
        st.integers(0, 3),  # replica
        st.lists(st.integers(0, 5), min_size=0, max_size=8),  # a prompt as block ids
    ),
    max_size=40,
)


def _chain(prompt: list[int]) -> list[int]:
    """Chained hashes: block i's hash encodes the whole prefix up to i."""
    return [hash(tuple(prompt[: i + 1])) for i in range(len(prompt))]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(ops=_ops, capacity=st.integers(0, 12), query=st.lists(st.integers(0, 5), max_size=8))
def test_match_never_exceeds_what_is_held(
    ops: list[tuple[str, int, list[int]]], capacity: int, query: list[int]
) -> None:
    index = PrefixIndex()
    held: dict[int, list[list[int]]] = {r: [] for r in range(4)}  # prompts inserted
    for r in range(4):
        index.add_replica(r, capacity)
    for op, replica, prompt in ops:
        if op == "insert":
            index.insert(replica, _chain(prompt))
            held[replica].append(prompt)
        elif op == "evict":
            index.evict(replica, len(prompt))
        else:
            index.remove_replica(replica)
            index.add_replica(replica, capacity)
            held[replica] = []
    chain = _chain(query)
    replicas, matched = index.match(chain)
    reported = dict(zip(replicas.tolist(), matched.tolist(), strict=True))
    for replica in range(4):
        longest = max((_common_prefix(p, query) for p in held[replica]), default=0)
        got = reported.get(replica, 0)
        assert got <= min(longest, capacity)
        assert got == index.match_replica(replica, chain)
        assert index.num_blocks(replica) <= capacity


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# "raw" inserts the block ids as they are, unchained: a later block can then be held
# without the first, as after an engine evicted on its own.
_model_ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "raw", "evict", "remove"]),
        st.integers(0, 3),
        st.lists(st.integers(0, 5), min_size=0, max_size=8),
    ),
    max_size=40,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    ops=_model_ops,
    capacities=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    queries=st.lists(st.lists(st.integers(0, 5), max_size=8), min_size=1, max_size=4),
)
def test_index_agrees_with_a_plain_lru_per_replica(
    ops: list[tuple[str, int, list[int]]], capacities: list[int], queries: list[list[int]]
) -> None:
    """Blocks shared by several replicas, dropped by some, evicted by capacity: every
    count, match and eviction order is what one LRU list per replica gives."""
    index = PrefixIndex()
    lists: dict[int, OrderedDict[int, None]] = {r: OrderedDict() for r in range(4)}
    for r, capacity in enumerate(capacities):
        index.add_replica(r, capacity)
    for op, replica, prompt in ops:
        lru = lists[replica]
        if op in ("insert", "raw"):
            blocks = _chain(prompt) if op == "insert" else prompt
            index.insert(replica, blocks)
            for block in reversed(blocks):
                lru[block] = None
                lru.move_to_end(block)
            while len(lru) > capacities[replica]:
                lru.popitem(last=False)
        elif op == "evict":
            assert index.evict(replica, len(prompt)) == min(len(prompt), len(lru))
            for _ in range(min(len(prompt), len(lru))):
                lru.popitem(last=False)
        else:
            index.remove_replica(replica)
            index.add_replica(replica, capacities[replica])
            lru.clear()
    for replica, lru in lists.items():
        assert index.num_blocks(replica) == int(index.block_counts[replica]) == len(lru)
    for query in queries:
        for chain in (_chain(query), query):
            runs = {r: len(list(takewhile(lru.__contains__, chain))) for r, lru in lists.items()}
            replicas, matched = index.match(chain)
            assert dict(zip(replicas.tolist(), matched.tolist(), strict=True)) == {
                r: run for r, run in runs.items() if run
            }
    for replica, lru in lists.items():  # the cold end goes first, in LRU order
        for block in list(lru):
            assert index.match_replica(replica, [block]) == 1
            index.evict(replica, 1)
            assert index.match_replica(replica, [block]) == 0

"""Property: the prefix index never reports more than was inserted and not evicted."""

from __future__ import annotations

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


@settings(max_examples=200, derandomize=True)
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

"""net/dht.should_provide: when a node re-sends its provider records."""

from compushare.net.dht import PROVIDE_REPLICAS, should_provide


def peers(n: int, start: int = 0) -> frozenset:
    return frozenset(f"peer-{i}" for i in range(start, start + n))


KEYS = ("model", "block-0", "block-1")


def test_new_or_due_keys_are_always_provided():
    big = peers(100)
    assert should_provide(KEYS, big, (), big, due=False)  # first round, or the span changed
    assert should_provide(KEYS, big, KEYS, big, due=True)
    assert not should_provide(KEYS, big, KEYS, big, due=False)


def test_a_small_table_re_provides_when_it_gains_peers():
    # Fewer than k peers had the records: every newcomer is among the k closest to each key.
    before = peers(PROVIDE_REPLICAS - 1)
    assert should_provide(KEYS, before | peers(1, 500), KEYS, before, due=False)
    assert not should_provide(KEYS, before, KEYS, before | peers(1, 500), due=False)  # only lost peers


def test_a_join_into_a_big_table_waits_for_the_periodic_refresh():
    # Otherwise each join would cost every node a look-up per key.
    before = peers(PROVIDE_REPLICAS)
    assert not should_provide(KEYS, before | peers(1, 500), KEYS, before, due=False)

"""The host steps before a request's first forward pass, made cheaper, give what they gave before:
remembered content keys equal ``content_key``'s."""
import random

from lazyrag.engine.reuse import ContentKeyMemo, Strategy
from lazyrag.kv.cache import content_key


def test_remembered_keys_are_content_keys_and_a_changed_list_gets_its_own():
    memo = ContentKeyMemo()
    prefix, chunk = [1, 2, 3], list(range(100, 700))
    key = memo("fp", "chunk", prefix, chunk)
    assert key == content_key("fp", "chunk", prefix, chunk)
    assert memo("fp", "chunk", list(prefix), [int(str(t)) for t in chunk]) == key  # equal values, other objects
    chunk[7] += 1  # the same list object, changed in place
    assert memo("fp", "chunk", prefix, chunk) == content_key("fp", "chunk", prefix, chunk) != key
    assert memo("fp", "prefix", prefix) == content_key("fp", "prefix", prefix)
    assert len(memo) == 3


def test_memo_holds_at_most_its_token_budget_oldest_out_first():
    memo = ContentKeyMemo(max_tokens=1000)
    chunks = [[i] * 300 for i in range(5)]
    for c in chunks:
        memo("fp", c)
    assert len(memo) == 3 and memo._tokens == 900  # the first two left
    assert memo("fp", chunks[0]) == content_key("fp", chunks[0])  # hashed again, and back in
    assert len(memo) == 3 and memo._tokens == 900
    memo("fp", [9] * 1001)  # more than the whole budget: keyed, not kept
    assert len(memo) == 3


def test_strategy_keys_are_the_definitions_stores_are_indexed_by():
    s = Strategy(cache=None, runner=None, fingerprint="fp")
    rng = random.Random(0)
    prefix, chunk = [rng.randrange(128256) for _ in range(32)], [rng.randrange(128256) for _ in range(512)]
    for _ in range(2):  # the second time from the memo
        assert s.chunk_key(prefix, chunk) == content_key("fp", "chunk", prefix, chunk)
        assert s.prefix_key(prefix) == content_key("fp", "prefix", prefix)

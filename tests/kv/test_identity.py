"""The content-key rule beside KVIdentity: how a chunk's and the shared prefix's cache keys are made
(the keys of corpus stores on disk were made by it), and the memo that remembers them."""

import hashlib
import random
from array import array

from lazyrag.kv.identity import ContentKeyMemo, chunk_key, content_key, prefix_key


def test_content_keys_stay_those_stores_on_disk_are_indexed_by():
    """sha256 over each part's length and bytes, token ids as ``array("q")`` packs them: pinned by a digest
    made before ids were packed with ``struct`` and by the ``array`` definition on random parts."""
    assert (
        content_key("fp", "chunk", [128000, 0, 7], [], (1, 2**40))
        == "2f25cc79a97775f248b5ecdddc891afc8fcd63d39810a36a7fe498d8fa79f9f6"
    )

    def by_array(*parts):
        h = hashlib.sha256()
        for p in parts:
            data = p.encode() if isinstance(p, str) else array("q", p).tobytes()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()

    rng = random.Random(0)
    for _ in range(50):
        parts = [
            rng.choice(["", "prefix", "chunk \u00e9"])
            if rng.random() < 0.4
            else [
                rng.randrange(-(2**63), 2**63) if rng.random() < 0.1 else rng.randrange(128256)
                for _ in range(rng.randrange(600))
            ]
            for _ in range(rng.randrange(1, 5))
        ]
        assert content_key(*parts) == by_array(*parts)


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


def test_chunk_and_prefix_keys_are_content_keys_of_the_fingerprint_and_ids():
    prefix, chunk = [1, 2, 3], list(range(100, 600))
    for _ in range(2):  # the second time from the memo
        assert chunk_key("fp", prefix, chunk) == content_key("fp", "chunk", prefix, chunk)
        assert prefix_key("fp", prefix) == content_key("fp", "prefix", prefix)
    assert chunk_key("fp", prefix, chunk) != chunk_key("other", prefix, chunk) != chunk_key("fp", [1, 2], chunk)

"""What checking index.faiss against the manifest's sha256 costs next to loading it (issue 29).

.venv/bin/python benchmarks/index_hash.py     # CPU; writes benchmarks/results/index_hash_cpu.json
"""

import hashlib
import json
import statistics
import time
from pathlib import Path

import faiss
import numpy as np


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


rows = []
for n in (2_600, 100_000):  # chunks of a 384-dim flat index (MiniLM): about 4 MB and 154 MB
    index = faiss.IndexIDMap(faiss.IndexFlatIP(384))
    index.add_with_ids(np.random.default_rng(0).random((n, 384), dtype=np.float32), np.arange(n))
    data = faiss.serialize_index(index)
    sha = median_ms(lambda data=data: hashlib.sha256(data).hexdigest())
    load = median_ms(lambda data=data: faiss.deserialize_index(data))
    rows.append({"chunks": n, "mb": data.nbytes / 1e6, "sha256_ms": sha, "deserialize_ms": load, "ratio": sha / load})
print(f"{'chunks':>8} {'MB':>6} {'sha256 ms':>10} {'load ms':>8} {'ratio':>6}")
for r in rows:
    print(f"{r['chunks']:>8} {r['mb']:>6.0f} {r['sha256_ms']:>10.1f} {r['deserialize_ms']:>8.1f} {r['ratio']:>6.2f}")
out = Path(__file__).parent / "results" / "index_hash_cpu.json"
out.write_text(
    json.dumps({"command": "python benchmarks/index_hash.py", "device": "cpu (2 cores)", "rows": rows}, indent=1)
)
print(f"wrote {out}")

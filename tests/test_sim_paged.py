"""The simulator's worker on a paged KV cache decodes as many rows as its pages hold at
the workload's lengths (the engine's rule, ``rlaxkit.rules.paging.rows_that_fit``)."""

import pytest

from rlaxkit.rules.trace import MemoryTrace
from sim import presets, simulate


def test_a_pool_of_one_rows_pages_decodes_one_sample_at_a_time():
    # The toy's samples hold 5 + 10 tokens: one 16-slot page each. A 16-slot pool runs
    # them one after the other (2.0 s, then 1.5 s more); 32 slots run both at once.
    ends = {}
    for pool in (16, 32):
        trace = MemoryTrace()
        overrides = {"target_steps": 1, "fleet.kv_pool_tokens": pool, "fleet.page_size": 16}
        simulate(presets.toy(**overrides), trace=trace)
        ends[pool] = [e.t for e in trace.events if e.kind == "generation_end"]
    assert ends[16] == pytest.approx([2.0, 3.5])
    assert ends[32] == pytest.approx([2.0, 2.0])

"""What the engine's config derives from its options: here, the batch sizes that get a graph."""

from __future__ import annotations

import pytest

from warpspec.config.engine import EngineConfig, SchedulerConfig, graph_batch_sizes


@pytest.mark.parametrize("sizes,max_num_seqs,kept", [
    ((1, 2, 4, 8, 16, 32), 256, (1, 2, 4, 8, 16, 32)),  # the default: every size
    ((1, 2, 4, 8, 16, 32), 8, (1, 2, 4, 8)),
    ((1, 2, 4, 8, 16, 32), 3, (1, 2, 4)),  # a batch of 3 pads to 4
    ((1, 2, 4, 8, 16, 32), 1, (1,)),
    ((8, 4, 4), 2, (4,)),  # unsorted, repeated: the first that holds 2
])
def test_graph_batch_sizes_stop_at_the_first_that_holds_max_num_seqs(sizes, max_num_seqs, kept):
    assert graph_batch_sizes(sizes, max_num_seqs) == kept


def test_one_sequence_at_a_time_gets_no_graph_for_several():
    def graphs(max_num_seqs: int):
        return EngineConfig("unread", device="cpu", enforce_eager=False,
                            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)).cuda_graph_config()

    assert graphs(1).batch_sizes == (1,) and not graphs(1).several_sequences
    assert graphs(2).batch_sizes == (1, 2) and graphs(2).several_sequences

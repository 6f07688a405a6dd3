"""The GPU a torchrun process picks: its LOCAL_RANK (a pure function; no GPU needed)."""

from __future__ import annotations

import pytest

from sao_core.training.distributed import local_device_index


def test_local_rank_chooses_the_gpu_not_the_global_rank():
    # node 2 of an uneven job: global rank 7 is the second process on a node with 4 GPUs (rank % 4 would be 3)
    assert local_device_index({"RANK": "7", "LOCAL_RANK": "1", "WORLD_SIZE": "9"}, 4) == 1
    assert local_device_index({"LOCAL_RANK": "0"}, 1) == 0
    assert local_device_index({"LOCAL_RANK": " 3 "}, 4) == 3


@pytest.mark.parametrize("environ, count, message", [
    ({"RANK": "3"}, 4, "LOCAL_RANK is not set"),
    ({"LOCAL_RANK": ""}, 4, "LOCAL_RANK is not set"),
    ({"LOCAL_RANK": "one"}, 4, "LOCAL_RANK must be an integer, got 'one'"),
    ({"LOCAL_RANK": "4"}, 4, r"LOCAL_RANK 4 has no GPU: this node sees 4 GPU\(s\)"),
    ({"LOCAL_RANK": "-1"}, 4, "LOCAL_RANK -1 has no GPU"),
    ({"LOCAL_RANK": "0"}, 0, r"LOCAL_RANK 0 has no GPU: this node sees 0 GPU\(s\)"),
])
def test_missing_or_impossible_local_rank_is_a_clear_error(environ, count, message):
    with pytest.raises(ValueError, match=message):
        local_device_index(environ, count)


def test_init_distributed_sets_the_gpu_of_local_rank(monkeypatch):
    """Under torchrun on GPUs (faked: no GPU here), global rank 7 with LOCAL_RANK 1 trains on cuda:1."""
    import torch
    import torch.distributed as dist

    from sao_core.training import distributed

    chosen = []
    monkeypatch.setattr(dist, "is_torchelastic_launched", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 7)
    monkeypatch.setattr(dist, "get_world_size", lambda: 9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    ctx = distributed.init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.device, chosen) == (7, 9, torch.device("cuda", 1), [1])
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="LOCAL_RANK is not set"):
        distributed.init_distributed()

"""The checkpointer's process group: a gloo job whose saves all block coordinates them over the
default group (no second full mesh of gloo connections: 2W² store calls at its creation); a job
that saves in the background keeps a group of its own, apart from the training collectives."""

from __future__ import annotations

from pathlib import Path

from tests.checkpoint_group_helpers import save_twice
from tests.ranks import run_ranks


def test_blocking_saves_share_the_default_group_and_background_ones_get_their_own(
    tmp_path: Path,
) -> None:
    results = run_ranks(save_twice, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["blocking"]["own_group"] is False, (rank, result)
        assert result["background"]["own_group"] is True, (rank, result)
        assert result["blocking"]["group_size"] == result["background"]["group_size"] == 2
    assert results[0]["blocking"]["committed"] == [1]
    assert results[0]["background"]["committed"] == [2]

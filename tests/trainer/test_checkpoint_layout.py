"""DP-scattered checkpoint writes: every file written exactly once, model shard m by DP index m mod DP."""

import itertools

import pytest

from moe_launch.trainer.checkpoint import layout


def _all_coords(dp: int, ep: int, strategy: str, is_moe: bool = True, pp: int = 1):
    for pp_rank, dp_rank, ep_rank in itertools.product(range(pp), range(dp), range(ep)):
        yield layout.Coords(rank=(pp_rank * dp + dp_rank) * ep + ep_rank, dp_rank=dp_rank, ep_rank=ep_rank,
                            ep_size=ep, optimizer_sharding=strategy, is_moe=is_moe, dp_size=dp, pp_rank=pp_rank,
                            pp_size=pp)


@pytest.mark.parametrize("dp,ep,pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (3, 4, 1), (1, 4, 1), (1, 1, 2),
                                      (2, 2, 2), (3, 2, 4)])
@pytest.mark.parametrize("strategy", ["none", "zero1", "epso"])
def test_writes_are_disjoint_and_cover_what_every_rank_reads(dp, ep, pp, strategy):
    coords = list(_all_coords(dp, ep, strategy, pp=pp))
    written = [f for c in coords for f in layout.writes(c)]
    assert len(written) == len(set(written)), "a file is written by two ranks"
    needed = {f for c in coords for f in layout.model_files(c)} | {layout.optimizer_file(c) for c in coords}
    needed |= {layout.rng_file(c) for c in coords} | {layout.TRAINER_FILE}
    assert set(written) == needed


def test_model_shards_are_scattered_over_dp():
    coords = list(_all_coords(dp=4, ep=2, strategy="epso"))
    writer_of = {f: c.dp_rank for c in coords for f in layout.writes(c, model_only=True)}
    # shard m (experts of EP rank m, the dense part as m = E) goes to DP index m mod DP
    assert writer_of == {"model/experts-ep0.pt": 0, "model/experts-ep1.pt": 1, "model/dense.pt": 2}


def test_dense_model_written_once_even_without_experts():
    coords = list(_all_coords(dp=2, ep=1, strategy="zero1", is_moe=False))
    model_writes = [f for c in coords for f in layout.writes(c, model_only=True)]
    assert model_writes == ["model/dense.pt"]


def test_stages_shards_are_scattered_over_dp_and_named_by_stage():
    coords = list(_all_coords(dp=2, ep=1, strategy="none", pp=2))
    writer_of = {f: (c.pp_rank, c.dp_rank) for c in coords for f in layout.writes(c)
                 if f.startswith(("model/", "optim/"))}
    # shards m = p * (E + 1) + (e | E): pp0 experts 0, pp0 dense 1, pp1 experts 2, pp1 dense 3 -> dp m mod 2; the
    # replicated optimizer file of (stage, EP rank) goes with its experts
    assert writer_of == {"model/pp0/experts-ep0.pt": (0, 0), "model/pp0/dense.pt": (0, 1),
                         "model/pp1/experts-ep0.pt": (1, 0), "model/pp1/dense.pt": (1, 1),
                         "optim/pp0-ep0.pt": (0, 0), "optim/pp1-ep0.pt": (1, 0)}

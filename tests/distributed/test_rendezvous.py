"""The rendezvous settings: torchrun's variables, and LeaderWorkerSet's standing in for them."""

from __future__ import annotations

import pytest

from model_server.distributed.rendezvous import Rendezvous, rendezvous_from_env

NAMES = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
LWS = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES + LWS:
        monkeypatch.delenv(name, raising=False)


def test_leaderworkerset_variables_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the LWS operator injects into a worker pod (index 1 of a group of 2).
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "wick-model-server-0.wick-model-server.ai")
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    rdzv = rendezvous_from_env()
    assert rdzv == Rendezvous("wick-model-server-0.wick-model-server.ai", 29500, 2, 1)
    assert rdzv.first_rank(4) == 2


def test_torchrun_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader")
    monkeypatch.setenv("LWS_GROUP_SIZE", "4")
    monkeypatch.setenv("LWS_WORKER_INDEX", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rendezvous_from_env() == Rendezvous("10.0.0.1", 29500, 2, 0)


def test_a_bad_stand_in_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LWS_GROUP_SIZE", "two")
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE must be an integer"):
        rendezvous_from_env()
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    with pytest.raises(ValueError, match="need MASTER_ADDR and MASTER_PORT"):
        rendezvous_from_env()

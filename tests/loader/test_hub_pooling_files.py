"""A hub id of a sentence-transformers model: the download takes its pooling files too (the
hub is replaced by a local "repo", all-MiniLM-L6-v2's folder, filtered by huggingface_hub's
own pattern matching)."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from model_server.engine.pooling.config import PoolingType
from model_server.engine.pooling.engine import detect_pooler
from model_server.loader import hub
from tests.engine.pooling.conftest import minilm_path


def test_hub_id_of_an_embedding_model_fetches_its_pooling_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = Path(minilm_path())
    files = [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()]
    snapshot = tmp_path / "snapshot"

    def fake_snapshot_download(repo_id, *, allow_patterns=None, ignore_patterns=None, **kw):
        assert repo_id == "sentence-transformers/all-MiniLM-L6-v2"
        for name in filter_repo_objects(files, allow_patterns=allow_patterns,
                                        ignore_patterns=ignore_patterns):  # fmt: skip
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    config = detect_pooler("sentence-transformers/all-MiniLM-L6-v2")
    assert config is not None
    assert (config.pooling_type, config.normalize, config.max_length) == (
        PoolingType.MEAN, True, 256,
    )  # fmt: skip
    fetched = {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}
    assert {"modules.json", "1_Pooling/config.json", "vocab.txt", "tokenizer.json"} <= fetched
    assert "model.safetensors" not in fetched  # detection fetches no weights
    hub.download("sentence-transformers/all-MiniLM-L6-v2")
    assert (snapshot / "model.safetensors").is_file()

"""A new run's sqlite MLflow store is seeded from a migrated empty one (cached once per machine)."""

from __future__ import annotations

import sqlite3

import mlflow

from tidal.tracking import _client, schema_template_dir


def experiments(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT experiment_id, name, artifact_location FROM experiments ORDER BY experiment_id").fetchall()


def temp_files(folder) -> list:
    return [p for p in folder.iterdir() if p.suffix == ".tmp"]


def test_new_stores_are_copies_of_one_migrated_template_each_with_its_own_default_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    template = schema_template_dir() / f"mlflow-{mlflow.__version__}.db"
    monkeypatch.chdir(tmp_path)
    first = _client(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    assert template.is_file() and experiments(template) == []  # no Default experiment carrying the builder's paths
    exp = first.create_experiment("x")
    run = first.create_run(exp)
    first.log_metric(run.info.run_id, "train/loss", 0.5, step=3)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    second = _client(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    assert [e.name for e in second.search_experiments()] == ["Default"]  # nothing of the first store
    assert experiments(tmp_path / "b" / "mlflow.db")[0][2].startswith((tmp_path / "elsewhere").as_uri().removeprefix("file://"))
    assert [(m.value, m.step) for m in first.get_metric_history(run.info.run_id, "train/loss")] == [(0.5, 3)]
    assert not temp_files(template.parent) and not temp_files(tmp_path / "b")


def test_an_existing_store_is_left_alone_and_an_unwritable_cache_still_gives_a_store(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TIDAL_CACHE", str(blocker))
    client = _client(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")  # MLflow migrates it itself
    assert "MLflow migrates the new store itself" in caplog.text
    exp = client.create_experiment("kept")
    again = _client(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    assert again.get_experiment(exp).name == "kept"

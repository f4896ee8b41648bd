"""`tidal ui` without a browser: which store and page it resolves, the one-line hint when only
mlflow-skinny is installed, and the tags and experiment `tidal run` gives the UI."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tidal import ui
from tidal.cli import main
from tidal.rundir import RunDir, RunInfo
from tidal.tracking import EXPERIMENT_KIND, create_run, start_run, tracking_uri


@pytest.fixture
def run_dir(tmp_path, tiny_config):
    """A run directory with its run.json and MLflow run, as `tidal run` leaves them (no iterations)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunDir(run_dir).save_info(RunInfo("run-1", "base", tracking_uri(tiny_config, run_dir), start_run(tiny_config, run_dir)))
    return run_dir


def test_the_run_is_tagged_and_its_experiment_typed_for_the_ui(run_dir):
    info = RunDir(run_dir).info()
    client = MlflowClient(tracking_uri=info.tracking_uri)
    run = client.get_run(info.mlflow_run_id)
    tags = run.data.tags
    assert tags["mode"] == tags["tidal.mode"] == "periodic" and tags["model"] == "tiny"
    assert tags["tidal.run_dir"] == str(run_dir.resolve())
    assert run.data.params["trainer.iterations"] == "3" and "rollout.group_size" in run.data.params  # dotted keys
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "tidal" and exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.artifact_location == (run_dir.resolve() / "mlartifacts").as_uri()  # beside the store, not in the cwd


def test_resolve_finds_the_run_page_the_experiment_page_or_the_home_page_in_the_model_training_view(run_dir):
    info = RunDir(run_dir).info()
    target = ui.resolve(str(run_dir), None)
    exp_id = MlflowClient(tracking_uri=info.tracking_uri).get_run(info.mlflow_run_id).info.experiment_id
    assert target.tracking_uri == info.tracking_uri
    assert target.path() == f"/#/experiments/{exp_id}/runs/{info.mlflow_run_id}?workflowType=machine_learning"
    assert target.path("model-metrics") == f"/#/experiments/{exp_id}/runs/{info.mlflow_run_id}/model-metrics?workflowType=machine_learning"
    experiment = ui.resolve(str(run_dir), None, experiment="tidal")
    assert experiment.path() == f"/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    assert experiment.path(compareRunsMode="CHART") == f"/#/experiments/{exp_id}/runs?compareRunsMode=CHART&workflowType=machine_learning"
    assert ui.resolve(None, info.tracking_uri).path() == "/"
    with pytest.raises(ValueError, match="no experiment named"):
        ui.resolve(None, info.tracking_uri, experiment="nope")


def test_without_the_full_mlflow_it_says_how_to_install_it_in_one_line(run_dir, monkeypatch, capsys):
    monkeypatch.setattr(ui, "have_mlflow_server", lambda: False)
    assert main(["ui", str(run_dir)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install" in err[0] and ".[ui]" in err[0] and "mlflow-skinny" in err[0]


def test_the_full_mlflow_is_installed_here():
    """The test extra carries the ui extra: the browser test and the README's `mlflow ui` need it."""
    assert ui.have_mlflow_server()


def test_a_store_that_is_already_a_server_is_not_served_again(monkeypatch, capsys):
    monkeypatch.setattr(ui, "serve", lambda *a, **k: pytest.fail("started a server"))
    assert main(["ui", "--tracking-uri", "http://mlflow.example:5000/"]) == 0
    assert capsys.readouterr().out.strip() == "MLflow UI: http://mlflow.example:5000/"


def test_no_store_and_a_missing_run_are_clear_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["ui"]) == 2
    assert "needs a run directory" in capsys.readouterr().err
    assert main(["ui", str(tmp_path)]) == 2
    assert "run.json not found" in capsys.readouterr().err
    assert main(["ui", "--tracking-uri", f"sqlite:///{tmp_path}/none.db"]) == 2
    assert "no such MLflow store" in capsys.readouterr().err


def test_the_server_command_binds_loopback_and_keeps_artifacts_beside_the_store(tmp_path):
    cmd = ui.server_command(f"sqlite:///{tmp_path}/mlflow.db", "127.0.0.1", 5123, 1)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5123"
    assert cmd[cmd.index("--default-artifact-root") + 1] == (tmp_path / "mlartifacts").as_uri()
    assert ui.free_port("127.0.0.1") > 0 and ui.url_host("0.0.0.0") == "127.0.0.1"


def test_mlflow_metric_names_fall_into_the_ui_groups():
    from tidal.tracking import mlflow_metric_name

    assert mlflow_metric_name("reward_mean") == "rollout/reward_mean"
    assert mlflow_metric_name("staleness_fraction_2") == "rollout/staleness_fraction_2"
    assert mlflow_metric_name("policy_loss") == "train/policy_loss" and mlflow_metric_name("grad_norm") == "train/grad_norm"
    assert (
        mlflow_metric_name("generate_seconds") == "time/generate_seconds" and mlflow_metric_name("pipeline_efficiency") == "time/pipeline_efficiency"
    )
    assert mlflow_metric_name("eval/accuracy") == "eval/accuracy"  # already grouped
    assert (
        mlflow_metric_name("accuracy_after") == "summary/accuracy_after"
        and mlflow_metric_name("total_groups_trained") == "summary/total_groups_trained"
    )


def test_every_experiment_tidal_creates_is_typed_for_the_model_training_view_and_an_existing_one_is_reused(tmp_path):
    """The pipeline's parent run and `tidal run` both create their experiment through tidal.tracking.create_run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp_id, run_id = create_run(uri, "fresh", "r1", {"k": "v"}, {f"p{i}": str(i) for i in range(150)})  # more params than one batch takes
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment(exp_id)
    assert experiment.tags[next(iter(EXPERIMENT_KIND))] == "custom_model_development"
    assert experiment.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()
    run = client.get_run(run_id)
    assert len(run.data.params) == 150 and run.data.tags["k"] == "v" and run.info.run_name == "r1"
    client.create_experiment("someone-elses", artifact_location=(tmp_path / "theirs").as_uri())  # created outside Tidal: reused as it is
    other_id, _ = create_run(uri, "someone-elses", "r2", {}, {})
    assert "mlflow.experimentKind" not in client.get_experiment(other_id).tags


def test_a_run_directory_moved_since_opens_the_store_it_carries(run_dir, tmp_path):
    """run.json records the store by its absolute path: a copied or moved run directory (from another
    machine, say) still opens, on its own mlflow.db."""
    import shutil

    info = RunDir(run_dir).info()
    moved = shutil.move(str(run_dir), str(tmp_path / "elsewhere"))
    target = ui.resolve(moved, None)
    assert target.tracking_uri == f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}" != info.tracking_uri
    assert target.run_id == info.mlflow_run_id and target.experiment_id is not None
    assert RunDir(moved).info().tracking_uri == target.tracking_uri  # run.json re-homed with it


def test_a_moved_store_records_its_artifacts_and_registered_versions_at_the_new_place_and_nothing_else_moves(tmp_path):
    """A real MLflow store with an artifact, a registered version and a neighbour whose path only starts like
    the old directory's: after the move and the rewrite, MLflow's own client reads the new paths and
    downloads the artifact from the new place."""
    import shutil

    from tidal.tracking import register_model, rewrite_store_paths

    old, new = tmp_path / "runs" / "a", tmp_path / "moved" / "a"
    old.mkdir(parents=True)
    uri = f"sqlite:///{old / 'mlflow.db'}"
    _, run_id = create_run(uri, "tidal", "r1", {}, {})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.txt").write_text("w")
    assert register_model(uri, run_id, "policy", tmp_path / "model", "exported") == "1"
    client = MlflowClient(tracking_uri=uri)
    neighbour = client.create_experiment("neighbour", artifact_location=(tmp_path / "runs" / "ab").as_uri())
    shutil.move(str(old), str(new))
    assert rewrite_store_paths(new / "mlflow.db", old, new) >= 4  # experiment, run, the version's source and storage
    client = MlflowClient(tracking_uri=f"sqlite:///{new / 'mlflow.db'}")
    assert client.get_run(run_id).info.artifact_uri.startswith(new.as_uri() + "/")
    (version,) = client.search_model_versions("name='policy'")
    assert version.source.startswith(new.as_uri() + "/") and version.source.endswith("/exported")
    assert client.get_experiment(neighbour).artifact_location == (tmp_path / "runs" / "ab").as_uri()  # not under the old directory
    got = client.download_artifacts(run_id, "exported/weights.txt", str(tmp_path / "down"))
    assert Path(got).read_text() == "w" and not old.exists()


def test_a_store_named_by_a_relative_sqlite_uri_is_not_re_homed_from_another_working_directory(tmp_path, monkeypatch):
    """tracking.uri `sqlite:///mlflow.db`, run from inside the run directory: its store is RUN_DIR/mlflow.db, but the
    recorded path says nothing of where the run was. Opened from the parent folder, the store is not "moved from"
    there (its artifact paths would have become RUN_DIR/runs/x/...)."""
    run_dir = tmp_path / "runs" / "x"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(run_dir)
    _, run_id = create_run("sqlite:///mlflow.db", "tidal", "r1", {}, {})
    RunDir(run_dir).save_info(RunInfo("run-1", "base", "sqlite:///mlflow.db", run_id))
    artifacts = MlflowClient(tracking_uri="sqlite:///mlflow.db").get_run(run_id).info.artifact_uri
    assert artifacts.startswith((run_dir / "mlartifacts").as_uri())
    monkeypatch.chdir(tmp_path)
    assert RunDir(Path("runs/x")).rehome_moved_store() is None
    assert RunDir(run_dir).info().tracking_uri == "sqlite:///mlflow.db"
    assert MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}").get_run(run_id).info.artifact_uri == artifacts


def test_a_live_run_seen_at_another_path_is_opened_but_not_re_homed(run_dir, tmp_path):
    """The same run directory under another path while its run is live (a container's bind mount, a network
    share): its processes log to the paths run.json records, so `tidal ui` reads the store it carries and
    rewrites nothing; once the run is over, the next command re-homes it."""
    import shutil

    from tidal.rundir import RunDirLock

    info = RunDir(run_dir).info()
    lock = RunDirLock(run_dir).acquire()  # the live run's launcher
    try:
        seen = Path(shutil.move(str(run_dir), str(tmp_path / "mounted")))  # the same directory (inode), another path
        target = ui.resolve(str(seen), None)
        assert target.tracking_uri == f"sqlite:///{seen / 'mlflow.db'}" and target.run_id == info.mlflow_run_id
        assert RunDir(seen).info().tracking_uri == info.tracking_uri  # run.json as the live run wrote it
        client = MlflowClient(tracking_uri=target.tracking_uri)
        assert client.get_run(info.mlflow_run_id).info.artifact_uri.startswith((run_dir.resolve() / "mlartifacts").as_uri())
    finally:
        lock.release()
    assert RunDir(seen).rehome_moved_store() == run_dir.resolve()


def test_a_moved_run_directory_it_cannot_write_still_opens(run_dir, tmp_path, monkeypatch):
    """A copy on a read-only mount (an archive of runs): re-homing cannot write, and `tidal ui` opens the store
    it carries as it is instead of failing with sqlite's traceback."""
    import shutil
    import sqlite3

    import tidal.tracking

    def read_only(*args):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    info = RunDir(run_dir).info()
    moved = Path(shutil.move(str(run_dir), str(tmp_path / "archive")))
    monkeypatch.setattr(tidal.tracking, "rewrite_store_paths", read_only)
    target = ui.resolve(str(moved), None)
    assert target.tracking_uri == f"sqlite:///{moved / 'mlflow.db'}" and target.run_id == info.mlflow_run_id
    assert RunDir(moved).info().tracking_uri == info.tracking_uri  # nothing rewritten


def test_a_moved_run_directorys_summary_names_the_store_and_weights_it_carries(run_dir, tmp_path):
    """summary.json holds the store as a sqlite URI, not a path: it moves with the directory too."""
    import json
    import shutil

    old = RunDir(run_dir)
    old.summary.write_text(
        json.dumps({"tracking_uri": old.info().tracking_uri, "final_weights": str(run_dir / "weights" / "v000002"), "mode": "periodic"})
    )
    moved = Path(shutil.move(str(run_dir), str(tmp_path / "elsewhere")))
    assert RunDir(moved).rehome_moved_store() == run_dir.resolve()
    summary = json.loads(RunDir(moved).summary.read_text())
    assert summary["tracking_uri"] == f"sqlite:///{moved.resolve() / 'mlflow.db'}"
    assert summary["final_weights"] == str(moved.resolve() / "weights" / "v000002") and summary["mode"] == "periodic"

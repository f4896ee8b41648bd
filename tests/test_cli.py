"""The `tidal` command's dispatch: every subcommand through its parser's handler, `plan` and `chaos`
with their own parsers behind it."""

import re

import pytest

from tests.conftest import ROOT
from tidal import cli

ROOT_CONFIG = "examples/arithmetic.yaml"
TRACKER_CITATION = re.compile(r"#\d+|DESIGN\s*§")


def subcommands():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]  # argparse keeps the subparsers here only
    return sub.choices


def test_every_subcommand_names_its_handler():
    choices = subcommands()
    assert {"run", "train", "rollout-worker", "eval", "bench", "plan", "chaos", "ui", "report", "export", "compile", "submit"} <= set(choices)
    without = [name for name, parser in choices.items() if not callable(parser.get_default("func"))]
    assert without == []


@pytest.mark.parametrize("name", ["plan", "chaos"])
def test_plan_and_chaos_get_every_word_in_order_options_and_help_included(name):
    words = ["--split", "1x1+1", "--set", "trainer.iterations=2", ROOT_CONFIG, "--json", "out.json", "--", "-x"]
    args = cli.build_parser().parse_args([name, *words])
    assert args.args == words
    assert args.func is {"plan": cli.plan_command, "chaos": cli.chaos_command}[name]
    assert cli.build_parser().parse_args([name, "--help"]).args == ["--help"]
    assert cli.build_parser().parse_args([name]).args == []


@pytest.mark.parametrize(("name", "own_option"), [("plan", "--split"), ("chaos", "--faults")])
def test_help_of_plan_and_chaos_is_their_own_parsers_and_cites_no_tracker_item(name, own_option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([name, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tidal {name} ") and own_option in out
    assert not TRACKER_CITATION.search(out), out


def test_top_level_help_cites_no_tracker_item(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "plan" in out and "chaos" in out and "submit" in out
    assert not TRACKER_CITATION.search(out), out


def test_an_option_before_the_config_reaches_the_planner(capsys):
    """The planner's own parser reads --split (and finds it malformed) although it comes before the config."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--split", "1x1", ROOT_CONFIG])
    assert str(exited.value.code).startswith("tidal plan: --split '1x1': expected WORKERSxTHREADS+TRAINER_THREADS")


def test_the_chaos_parser_still_refuses_what_it_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["chaos", ROOT_CONFIG, "--faults", "worker-kill,disk-melt"])
    assert exited.value.code == 2 and "unknown fault(s) disk-melt" in capsys.readouterr().err


def test_a_missing_config_is_one_line_for_chaos_as_for_run(tmp_path, capsys):
    for argv in (["chaos", str(tmp_path / "nope.yaml")], ["run", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"tidal: config file not found: {tmp_path / 'nope.yaml'}"]


def test_run_without_run_dir_uses_runs_and_the_config_files_name(tmp_path, write_config):
    """As the README's `tidal run examples/calculator.yaml` is written: the run directory is runs/calculator
    under the working directory (here a run refused at its checks, after it took the directory)."""
    import os
    import subprocess
    import sys

    config = write_config({"reward.functions": [{"name": "nosuch.mod:f"}]}, name="calculator.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", str(config), "--no-progress"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ,
        timeout=600,
    )
    assert proc.returncode == 2 and "cannot import module 'nosuch.mod'" in proc.stderr, proc.stderr[-3000:]
    assert "required" not in proc.stderr and "tidal: run directory runs/calculator" in proc.stdout
    assert (tmp_path / "runs" / "calculator" / "lock").is_file()


def test_run_without_run_dir_on_a_run_directorys_own_config_resumes_that_run(tmp_path):
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "run.json").write_text("{}")
    assert cli.default_run_dir(str(tmp_path / "runs" / "mine" / "config.yaml")) == tmp_path / "runs" / "mine"
    assert cli.default_run_dir("examples/arithmetic.yaml") == cli.Path("runs/arithmetic")
    assert cli.default_run_dir(str(tmp_path / "config.yaml")) == cli.Path("runs/config")  # no run beside it


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_the_config_a_run_writes_before_run_json_is_taken_for_its_own_and_resumes(tmp_path, example):
    """A run stopped before it wrote run.json (Ctrl-C in the warm start) left only its config.yaml: that file
    names its run directory and is not refused as a person's config in the way (every example round-trips)."""
    from tidal.config import dump_config, load_config

    run_dir = tmp_path / "runs" / "mine"
    (run_dir / "logs").mkdir(parents=True)
    written = run_dir / "config.yaml"
    written.write_text(dump_config(load_config(ROOT / "examples" / example)))
    assert cli.default_run_dir(str(written)) == cli.Path("runs/config")  # no run was launched there: a copy
    (run_dir / "logs" / "launcher.log").write_text("")
    assert cli.default_run_dir(str(written)) == run_dir
    cli.refuse_config_in_the_way(str(written), str(run_dir))  # not refused
    written.write_text(written.read_text() + "# my notes\n")  # a person edited it: it is theirs now
    assert cli.default_run_dir(str(written)) == cli.Path("runs/config")
    with pytest.raises(cli.RunDirError, match="which is the config file given"):
        cli.refuse_config_in_the_way(str(written), str(run_dir))


def test_a_config_file_where_the_run_writes_its_resolved_config_is_refused_not_overwritten(tmp_path, write_config):
    """`tidal run config.yaml --run-dir .` in a project folder: the user's config would be replaced by the resolved one."""
    import os
    import subprocess
    import sys

    config = write_config()
    text = config.read_text() + "# my notes\n"
    config.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "run", "config.yaml", "--run-dir", ".", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ,
        timeout=600,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "which is the config file given: use another --run-dir" in proc.stderr
    assert config.read_text() == text


def test_the_tidal_command_imports_module_function_names_from_the_working_directory(tmp_path):
    """The installed `tidal` script (not `python -m`) validates a config naming a module that sits in the
    working directory; a run directory blocked by a file then stops it, after the config was accepted."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "mine.py").write_text("def median_baseline(rewards, *, std_normalize):\n    return rewards - rewards.median()\n")
    config = (ROOT / ROOT_CONFIG).read_text().replace("trainer:\n", 'trainer:\n  advantage: "mine:median_baseline"\n', 1)
    (tmp_path / "config.yaml").write_text(config)
    (tmp_path / "blocked").write_text("")
    script = Path(sys.executable).parent / "tidal"
    done = subprocess.run([str(script), "run", "config.yaml", "--run-dir", "blocked"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "cannot import module" not in done.stderr, done.stderr
    assert "a file is in the way of the run directory" in done.stderr and done.returncode != 0

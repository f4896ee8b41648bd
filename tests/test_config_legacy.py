"""Old keys keep working where users have them: the multi-turn keys once flat under `rollout` (now
`rollout.agent`) and a judge's `batch_size` load, with one warning line naming each old key and its new
place; a run directory's config.yaml saved before the change loads and compares equal to the same
settings written today, so a resume goes on."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tidal.config import ConfigError, config_from_dict, dump_config, load_config, training_changes
from tidal.config.legacy import AGENT_KEYS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA = ROOT / "tests" / "data"
SAVED_AGENT = DATA / "config-saved-before-agent-block.yaml"  # written by main's code (6725886), see its first lines
SAVED_SINGLE_TURN = DATA / "config-saved-single-turn-before-agent-block.yaml"


def old_form(data: dict) -> dict:
    """A config in the form before rollout.agent: the agent keys flat under rollout."""
    data = copy.deepcopy(data)
    rollout = data.get("rollout", {})
    rollout.update(rollout.pop("agent", None) or {})
    return data


def loaded(source, overrides=()) -> tuple[dict, list[str]]:
    notes: list[str] = []
    if isinstance(source, dict):
        cfg = config_from_dict(source, "old.yaml", on_old_keys=notes.append)
    else:
        cfg = load_config(source, list(overrides), on_old_keys=notes.append)
    return cfg.model_dump(mode="json"), notes


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_examples_old_form_loads_to_the_same_settings_with_one_line_naming_the_moved_keys(name, monkeypatch):
    monkeypatch.chdir(EXAMPLES)  # the examples' data paths are relative to their folder
    data = yaml.safe_load((EXAMPLES / name).read_text())
    new, new_notes = loaded(data)
    old, old_notes = loaded(old_form(data))
    assert old == new and new_notes == []
    agent = data["rollout"].get("agent")
    if agent is None:
        assert old_notes == [] and new["rollout"]["agent"] is None
        return
    (line,) = old_notes
    assert "\n" not in line
    for key in agent:
        assert f"rollout.{key}" in line and f"rollout.agent.{key}" in line


def test_the_shipped_examples_are_in_todays_form():
    for path in EXAMPLES.glob("*.yaml"):
        rollout = yaml.safe_load(path.read_text()).get("rollout", {})
        assert not set(rollout) & set(AGENT_KEYS), f"{path.name} has old keys under rollout"


def test_a_run_directorys_config_saved_before_the_change_loads_and_compares_equal():
    today = load_config(
        EXAMPLES / "calculator.yaml",
        [
            'reward.functions=[{name: exact_match}, {type: reward_model, name: rm, url: "http://127.0.0.1:9/score", batch_size: 8},'
            ' {type: judge, name: judge, url: "http://127.0.0.1:9/v1", model: m, score: number, weight: 0.5}]',
            "rollout.agent.tool_latency={p50_seconds: 0.05}",
            "rollout.generation_token_budget=16384",  # the example's values when the file was saved (changed since)
            "rollout.workers=1",
            "rollout.groups_per_batch=null",
        ],
    )
    saved, notes = loaded(SAVED_AGENT)
    assert saved == today.model_dump(mode="json")
    assert training_changes(load_config(SAVED_AGENT, on_old_keys=lambda note: None), today) == []
    assert len(notes) == 2 and "rollout.tool_latency" in notes[0] and "rollout.agent.tool_latency" in notes[0]
    assert notes[1].endswith("reward.functions[judge].batch_size is not read (a judge sends one sample per request): leave it out")
    # written back today, it loads with no warning and the same settings
    again, more = loaded(config_from_dict(yaml.safe_load(dump_config(today))).model_dump(mode="json"))
    assert again == saved and more == []


def test_resuming_a_run_directory_started_before_the_change_goes_on(tmp_path):
    from tidal.local import check_saved_config
    from tidal.rundir import RunDir

    run = RunDir(tmp_path)
    run.config.write_text(SAVED_SINGLE_TURN.read_text())
    run.info_file.write_text("{}")  # started
    check_saved_config(load_config(EXAMPLES / "arithmetic-rm.yaml"), run)  # same settings, today's form: no refusal
    multi_turn = ["rollout.agent={env: tools}", "eval.engine=hf", "model.warm_start.stop_at_accuracy=null"]
    with pytest.raises(ConfigError, match=r"would change training: .*rollout.agent.env \(unset -> tools\)"):
        check_saved_config(load_config(EXAMPLES / "arithmetic-rm.yaml", multi_turn), run)


def test_a_single_turn_run_directorys_config_saved_before_the_change_reads_as_no_agent():
    saved, notes = loaded(SAVED_SINGLE_TURN)
    today = load_config(EXAMPLES / "arithmetic-rm.yaml")
    assert saved == today.model_dump(mode="json") and saved["rollout"]["agent"] is None
    (line,) = notes
    assert "rollout.env, rollout.tools" in line and "read as rollout.agent unset: leave them out" in line


def test_an_old_key_set_by_an_override_on_a_new_form_file_goes_into_rollout_agent():
    cfg, notes = loaded(EXAMPLES / "calculator.yaml", ["rollout.max_turns=2"])
    assert cfg["rollout"]["agent"]["max_turns"] == 2 and cfg["rollout"]["agent"]["tools"] == ["calc"]
    (line,) = notes
    assert "rollout.max_turns" in line and "rollout.agent.max_turns" in line


def test_old_agent_keys_without_an_environment_are_refused_naming_them():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rollout": {"env": None, "max_turns": 3, "tool_latency": {"p50_seconds": 0.1}}}, "old.yaml")
    message = str(err.value)
    assert message.startswith("invalid config (old.yaml): rollout.max_turns, rollout.tool_latency: only for multi-turn rollouts")
    assert "\n" not in message


def test_tidal_run_logs_and_prints_the_old_keys_once(tmp_path, tiny_config_dict):
    """The warning reaches the terminal and the launcher's log, once (the run stops at its first check: no NATS)."""
    data = copy.deepcopy(tiny_config_dict)
    data["rollout"].update({"env": "tools", "tools": ["calc"], "max_turns": 2})
    data["transport"] = {"nats_url": "nats://127.0.0.1:1"}
    data["eval"] = {"enabled": False}
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode != 0 and "cannot reach NATS" in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "rollout.agent.max_turns" in line]
    assert len(lines) == 1 and lines[0].startswith("tidal: warning: ") and "rollout.env, rollout.tools, rollout.max_turns" in lines[0]
    log = (tmp_path / "run" / "logs" / "launcher.log").read_text()
    assert log.count("rollout.agent.max_turns") == 1

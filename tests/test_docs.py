"""The user's manual stays true to the code: docs/configuration.md is what the config schema renders,
and the README's links into docs/ lead somewhere. (`make docs` builds the site strictly: broken links
and anchors between pages, and pages missing from mkdocs.yml's nav, fail there.)"""

import re
import subprocess
import sys
from pathlib import Path

from pydantic import Field

from tidal.config import NON_TRAINING_KEYS, TidalConfig, TrainerConfig
from tidal.config_reference import _blocks, anchor, config_keys, current, main, render, stale_diff

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m tidal.config_reference docs/configuration.md"


def test_the_configuration_reference_matches_the_schema():
    diff = stale_diff(REFERENCE, current())
    assert not diff, f"docs/configuration.md is out of date with the schema in src/tidal/config/: run `{REGENERATE}`\n{diff}"


class _ChangedTrainer(TrainerConfig):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")  # another default
    new_knob: int = Field(7, description="a key the schema gained")


class _ChangedSchema(TidalConfig):
    trainer: _ChangedTrainer = _ChangedTrainer()


def test_a_changed_schema_makes_the_reference_stale(tmp_path):
    changed = render(_ChangedSchema, NON_TRAINING_KEYS)
    assert changed != current()
    assert "| `trainer.new_knob` | int | `7` | a key the schema gained |" in changed
    assert "| `trainer.lr` | float (> 0) | `0.001` |" in changed
    diff = stale_diff(REFERENCE, changed)
    assert "trainer.new_knob" in diff and "trainer.lr" in diff
    # and the command's --check says so, while the current reference passes it
    stale = tmp_path / "configuration.md"
    stale.write_text(changed)
    assert main(["--check", str(stale)]) == 1
    assert main(["--check", str(REFERENCE)]) == 0
    assert main(["--check", str(tmp_path / "missing.md")]) == 1


def test_every_key_of_every_block_is_documented():
    text = current()
    keys = config_keys(TidalConfig)
    assert {"mode", "trainer.lr", "rollout.vllm.weight_sync", "reward.functions[].name", "rollout.agent.tools"} <= keys
    for key in keys:
        assert f"| `{key}` |" in text, key
    # every field of every block says what it does, in its Field(description=...)
    undescribed = [f"{path}.{name}" for path, _, cls in _blocks(TidalConfig) for name, field in cls.model_fields.items() if not field.description]
    assert undescribed == []


def test_each_kind_of_reward_entry_is_a_block_of_its_own_with_only_its_keys():
    text = current()
    for kind in ("function", "reward_model", "judge"):
        assert f"## `reward.functions[]` of type `{kind}`" in text
    judge = text.split("## `reward.functions[]` of type `judge`")[1].split("\n## ")[0]
    assert "`reward.functions[].prompt_template`" in judge and "`reward.functions[].serve`" not in judge


def test_descriptions_come_from_the_schema_and_built_in_names_from_the_registries(monkeypatch):
    text = current()
    # a field's description, and a block's class docstring
    assert "HF directory or hub id" in text
    assert "Architecture of the built-in tiny model" in text
    assert "Built in: `calc`, `python`." in text and "Built in: `exact_match`, `format`, `math_verify`." in text
    # a tool the registry gains is listed without another edit
    from tidal.envs import tools

    monkeypatch.setitem(tools.BUILT_IN_TOOLS, "search", tools.calc)
    assert "Built in: `calc`, `python`, `search`." in current()
    # the nested blocks link to their sections, by the anchors MkDocs and GitHub give the headings
    assert anchor("`model.warm_start`") == "modelwarm_start"
    assert "[see below](#modelwarm_start)" in text and "## `model.warm_start`" in text


def test_the_reference_module_imports_no_torch():
    code = (
        "import sys, tidal.config; before = set(sys.modules); import tidal.config_reference; "
        "added = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'transformers', 'mlflow', 'nats')); "
        "print(added); sys.exit(1 if added else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def headings_anchors(markdown: str) -> set[str]:
    """The anchors of a page's headings (fenced code skipped), as MkDocs and GitHub make them."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return {anchor(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def test_the_readme_links_into_docs_resolve():
    """mkdocs checks the links between pages of docs/; the README is outside it, so this checks its links."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    assert any(link.startswith("docs/") for link in local), "the README links into docs/"
    for link in local:
        path, _, fragment = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {path}, which does not exist"
        if fragment:
            assert fragment in headings_anchors(target.read_text()), f"README.md links to {link}: no such heading in {path}"


def test_every_page_is_in_the_nav_and_no_page_cites_internal_documents():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), f"docs/{page.name} is not in mkdocs.yml's nav"
        text = page.read_text()
        assert "DESIGN.md" not in text and "../shared" not in text, f"docs/{page.name} cites a document users do not have"

"""The advantage and policy-loss registries: one decorated function adds a name, config validation reads it,
and every registered advantage estimator gives exactly zero to a group without signal."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tidal.algo
from tidal.algo import (
    ADVANTAGES,
    POLICY_LOSSES,
    compute_advantages,
    has_no_signal,
    policy_token_loss,
    ppo_clip_token_loss,
    register_advantage,
    register_policy_loss,
)
from tidal.config import ConfigError, config_from_dict

ALGO_DIR = Path(tidal.algo.__file__).parent


@pytest.fixture
def scratch_names():
    """Names registered by a test, removed from the registries afterwards."""
    added: list[tuple[dict, str]] = []

    def track(registry: dict, name: str) -> str:
        added.append((registry, name))
        return name

    yield track
    for registry, name in added:
        registry.pop(name, None)


def test_builtin_names_are_registered():
    assert sorted(ADVANTAGES) == ["dr_grpo", "grpo", "rloo"]
    assert sorted(POLICY_LOSSES) == ["gspo", "ppo_clip"]
    assert ADVANTAGES["grpo"] is tidal.algo.grpo_advantages and POLICY_LOSSES["ppo_clip"] is ppo_clip_token_loss


def test_a_config_with_built_in_algorithms_loads_without_torch():
    """The config checks built-in names against tidal.algo.names, which needs no torch (a pipeline step that
    reads the config to talk to NATS or the API stays light)."""
    code = (
        "import sys; from tidal.config import config_from_dict; "
        "cfg = config_from_dict({'trainer': {'advantage': 'rloo', 'policy_loss': 'gspo', 'kl_estimator': 'k2'}}); "
        "print(cfg.trainer.advantage, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["rloo", "False"], done.stderr


def test_a_registry_whose_built_ins_are_not_the_listed_names_does_not_import():
    from tidal.algo.registry import check_built_ins

    check_built_ins({"grpo": None, "rloo": None}, "advantage estimator", ("rloo", "grpo"))
    with pytest.raises(ImportError, match=r"the built-in advantage estimators \['grpo', 'new'\] are not tidal.algo.names' \['grpo'\]"):
        check_built_ins({"grpo": None, "new": None}, "advantage estimator", ("grpo",))


def test_registering_a_taken_name_is_an_error():
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered.*grpo_advantages"):
        register_advantage("grpo")(lambda rewards, *, std_normalize: rewards)
    with pytest.raises(ValueError, match="policy loss 'gspo' is already registered"):
        register_policy_loss("gspo")(ppo_clip_token_loss)
    assert ADVANTAGES["grpo"] is tidal.algo.grpo_advantages and POLICY_LOSSES["gspo"] is tidal.algo.gspo_token_loss


def test_unknown_names_are_clear_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.advantage: unknown advantage estimator 'foo': choose from \['dr_grpo', 'grpo', 'rloo'\]"):
        config_from_dict({"trainer": {"advantage": "foo"}})
    with pytest.raises(ConfigError, match=r"^invalid config \(<dict>\): trainer\.kl_estimator: Input should be 'k1', 'k2' or 'k3' \(got 'k4'\)$"):
        config_from_dict({"trainer": {"kl_estimator": "k4"}})
    with pytest.raises(ConfigError, match=r"trainer\.policy_loss: unknown policy loss 'reinforce': choose from \['gspo', 'ppo_clip'\]"):
        config_from_dict({"trainer": {"policy_loss": "reinforce"}})


def test_a_registered_advantage_is_a_config_value_and_used_by_compute_advantages(scratch_names):
    name = scratch_names(ADVANTAGES, "test_max_baseline")

    @register_advantage(name)
    def max_baseline(rewards: torch.Tensor, *, std_normalize: bool) -> torch.Tensor:
        return rewards - rewards.max()

    cfg = config_from_dict({"trainer": {"advantage": name}})
    assert cfg.trainer.advantage == name
    got = compute_advantages(cfg.trainer.advantage, torch.tensor([1.0, 3.0, 2.0]), cfg.trainer.std_normalize)
    assert torch.equal(got, torch.tensor([-2.0, 0.0, -1.0]))


def test_a_registered_policy_loss_is_a_config_value_and_used_by_policy_token_loss(scratch_names):
    name = scratch_names(POLICY_LOSSES, "test_reinforce")

    @register_policy_loss(name)
    def reinforce(logp, old_logp, advantages, *, mask, clip_low, clip_high):
        return -logp * advantages * mask, torch.zeros_like(mask, dtype=torch.bool)

    cfg = config_from_dict({"trainer": {"policy_loss": name}})
    logp, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 0.0]])
    loss, clipped = policy_token_loss(cfg.trainer.policy_loss, logp, logp, torch.tensor([[2.0]]), mask, 0.2, 0.2)
    assert torch.equal(loss, torch.tensor([[2.0, 0.0]])) and not clipped.any()


def test_a_name_removed_from_the_registry_is_no_longer_a_config_value(scratch_names):
    name = scratch_names(ADVANTAGES, "test_transient")
    register_advantage(name)(lambda rewards, *, std_normalize: rewards - rewards.mean())
    config_from_dict({"trainer": {"advantage": name}})
    ADVANTAGES.pop(name)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'test_transient'"):
        config_from_dict({"trainer": {"advantage": name}})


@pytest.mark.parametrize("estimator", sorted(ADVANTAGES))
@pytest.mark.parametrize("value", [0.1, 1.1, 1 / 3, 0.0, 1.0, -7.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("std_normalize", [True, False], ids=["std", "no_std"])
def test_an_all_equal_group_gets_exactly_zero_advantage(estimator, value, dtype, std_normalize):
    # 0.1, 1.1, 1/3 are not representable: their float mean is off by an ulp, which a std division used to blow up to ~1e-2
    for size in (1, 2, 7, 8, 16):
        rewards = torch.full((size,), value, dtype=dtype)
        adv = compute_advantages(estimator, rewards, std_normalize)
        assert adv.dtype == dtype and adv.shape == rewards.shape
        assert (adv == 0).all(), f"{estimator} gives {adv.tolist()} to {size} x {value!r} ({dtype})"
        assert has_no_signal(rewards)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGES))
def test_a_group_with_signal_gets_nonzero_advantages(estimator):
    rewards = torch.tensor([0.1] * 7 + [0.2])
    assert not has_no_signal(rewards)
    assert (compute_advantages(estimator, rewards) != 0).all()


def test_algo_imports_only_torch_and_the_standard_library():
    for path in ALGO_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                ok = module == "tidal.algo" or module.startswith("tidal.algo.") or top == "torch" or top in _stdlib()
                assert ok, f"{path.name} imports {module}"


def test_token_logprobs_live_in_algo_and_the_packing_module_reuses_them():
    from tidal.algo.logprobs import token_logprobs_from_logits
    from tidal.trainer import packing

    assert tidal.algo.token_logprobs_from_logits is token_logprobs_from_logits is packing.token_logprobs_from_logits


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}


def test_a_users_module_function_is_a_valid_advantage_and_is_used(scratch_names):
    name = scratch_names(ADVANTAGES, "tests.rewards:median_baseline")
    cfg = config_from_dict({"trainer": {"advantage": name}})
    assert cfg.trainer.advantage == name
    rewards = torch.tensor([0.0, 1.0, 5.0])
    assert compute_advantages(name, rewards).tolist() == [-1.0, 0.0, 4.0]
    with pytest.raises(
        ConfigError, match=r"trainer\.advantage: advantage estimator 'tests.rewards:nope': module 'tests.rewards' has no function 'nope'"
    ):
        config_from_dict({"trainer": {"advantage": "tests.rewards:nope"}})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg'"):
        config_from_dict({"trainer": {"policy_loss": "no_such_pkg:loss"}})

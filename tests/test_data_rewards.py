import json
import logging
from pathlib import Path

import pytest

from tidal.config import DataConfig, RewardConfig
from tidal.data import DatasetError, load_dataset, make_arithmetic, prompts_for_iteration, read_jsonl_problems
from tidal.rewards import RewardError, RewardScorer, exact_match, extract_final_answer, format_reward, resolve

DATA = Path(__file__).parent / "data"


def test_arithmetic_is_deterministic_and_held_out_is_disjoint():
    a = make_arithmetic(3, 200, 50, 2, ["+", "-"])
    b = make_arithmetic(3, 200, 50, 2, ["+", "-"])
    assert a == b
    assert {p.prompt for p in a.train}.isdisjoint({p.prompt for p in a.eval})
    assert make_arithmetic(4, 200, 50, 2, ["+", "-"]).train != a.train
    for p in a.train[:20]:
        assert str(eval(p.prompt.rstrip("="))) == p.answer


def test_prompts_for_iteration_depend_on_seed_and_iteration_only():
    ds = make_arithmetic(0, 100, 10, 2, ["+"])
    assert prompts_for_iteration(ds, 0, 5, 8) == prompts_for_iteration(ds, 0, 5, 8)
    assert prompts_for_iteration(ds, 0, 5, 8) != prompts_for_iteration(ds, 0, 6, 8)


def test_gsm8k_jsonl_rows_are_read():
    problems = read_jsonl_problems(DATA / "gsm8k_sample.jsonl")
    assert len(problems) == 20
    first = json.loads((DATA / "gsm8k_sample.jsonl").read_text().splitlines()[0])
    assert problems[0].prompt.startswith(first["question"][:30])
    assert problems[0].answer == first["answer"].split("####")[-1].strip().replace(",", "")


def test_missing_dataset_file_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found: .*missing.jsonl"):
        load_dataset(DataConfig(task="jsonl", path=str(tmp_path / "missing.jsonl")), 0)


def test_bad_rows_name_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": 5}\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: a row needs"):
        read_jsonl_problems(path)
    path.write_text('{"question": "1+1?", "answer": "2"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: not valid JSON"):
        read_jsonl_problems(path)


def test_exact_match_and_format():
    assert extract_final_answer("A: 12\nA: -7") == "-7"
    assert exact_match("A: -7", "-7") == 1.0
    assert exact_match("A: 8", "-7") == 0.0
    assert exact_match("no answer", "3") == 0.0
    assert exact_match("#### 1,234", "1234") == 1.0
    assert format_reward("A: 5", "9") == 1.0
    assert format_reward("5", "5") == 0.0


def user_reward(completion: str, answer: str) -> float:
    return 0.5


def broken_reward(completion: str, answer: str) -> float:
    raise RuntimeError("user bug")


def test_rows_past_the_limit_are_left_with_a_warning_that_names_the_key(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)) + "\n")
    with caplog.at_level(logging.WARNING, logger="tidal.data"):
        assert [p.answer for p in read_jsonl_problems(path, 3)] == ["1", "2", "3"]
    assert f"{path}: read its first 3 rows and left 2 more (data.num_train / data.num_eval is 3)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tidal.data"):
        assert len(read_jsonl_problems(path, 5)) == 5
    assert caplog.text == ""


def test_user_functions_by_module_path_and_errors():
    assert resolve("tests.test_data_rewards:user_reward") is user_reward
    with pytest.raises(RewardError, match="unknown reward function 'nope'"):
        resolve("nope")
    with pytest.raises(RewardError, match="cannot import module"):
        resolve("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="no callable"):
        resolve("tests.test_data_rewards:absent")


def test_a_raising_reward_scores_zero_logs_and_counts(caplog):
    cfg = RewardConfig(functions=[{"name": "exact_match"}, {"name": "tests.test_data_rewards:broken_reward", "weight": 2.0}])
    scorer = RewardScorer.from_config(cfg)
    with caplog.at_level(logging.WARNING):
        reward, parts = scorer.score("A: 3", "3")
    assert reward == 1.0 and parts["tests.test_data_rewards:broken_reward"] == 0.0
    assert scorer.errors == 1 and "user bug" in caplog.text


def nan_reward(completion: str, answer: str) -> float:
    return float("nan")


def string_reward(completion: str, answer: str):
    return "0.5"


@pytest.mark.parametrize("bad", ["nan_reward", "string_reward"])
def test_a_reward_that_is_not_a_finite_number_is_an_error_counted_and_scores_zero(bad, caplog):
    name = f"tests.test_data_rewards:{bad}"
    scorer = RewardScorer.from_config(RewardConfig(functions=[{"name": "exact_match"}, {"name": name}]))
    reward, parts = scorer.score("A: 3", "3")
    assert reward == 1.0 and parts[name] == 0.0 and scorer.errors == 1
    assert "not a finite number" in scorer.last_error or "str '0.5', not a number" in scorer.last_error


def test_numpy_and_integer_rewards_are_numbers():
    import numpy as np

    from tidal.rewards import checked_reward

    assert checked_reward(np.float32(0.25)) == 0.25 and checked_reward(1) == 1.0
    for bad in (float("inf"), None, True, "1"):
        with pytest.raises((TypeError, ValueError)):
            checked_reward(bad)


# Hand-labelled completions on which the regex (`exact_match`) and math-verify disagree, both ways.
# The label is what a grader reading the completion would say.
DISAGREEMENTS = [
    # (completion, answer, hand label, regex, math-verify)
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 0.0, 1.0),  # LaTeX fraction in a box
    ("The answer is 3/4", "0.75", 1.0, 0.0, 1.0),  # a plain fraction, no A: line
    ("$1,234.50", "1234.5", 1.0, 0.0, 1.0),  # currency and a thousands separator
    ("A: 1/2", "0.5", 1.0, 0.0, 1.0),  # the regex reads only decimals
    ("A: 7 no wait 9", "7", 0.0, 1.0, 0.0),  # changed its mind: the regex trusts the first A:
    ("#### 7\nbut I think it is 9", "7", 0.0, 1.0, 0.0),  # the same after ####
]


@pytest.mark.parametrize("completion,answer,label,regex,verified", DISAGREEMENTS)
def test_math_verify_and_the_regex_disagree_both_ways_and_math_verify_matches_the_hand_label(completion, answer, label, regex, verified):
    from tidal.rewards import math_verify_reward

    assert exact_match(completion, answer) == regex
    assert math_verify_reward(completion, answer) == verified == label


def test_math_verify_is_registered_and_scores_on_worker_threads():
    from concurrent.futures import ThreadPoolExecutor

    scorer = RewardScorer.from_config(RewardConfig(functions=[{"name": "math_verify"}]))
    with ThreadPoolExecutor(1) as pool:  # workers score off the main thread, where SIGALRM timeouts cannot work
        reward, parts = pool.submit(scorer.score, "so \\boxed{42}", "42").result()
    assert reward == 1.0 and parts == {"math_verify": 1.0} and scorer.errors == 0

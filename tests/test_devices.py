"""trainer.device: 'auto' picks what the process can see; an absent accelerator is a named error."""

import pytest
import torch

from tidal.config import config_from_dict
from tidal.devices import device_problem, resolve_device


def test_default_trainer_device_is_auto_and_resolves_to_what_this_process_sees():
    assert config_from_dict({}).trainer.device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "npu" if getattr(torch, "npu", None) and torch.npu.is_available() else "cpu"
    assert resolve_device("auto") == expected


def test_explicit_devices_pass_through():
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("cuda:0") == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the error case cannot happen")
def test_an_accelerator_the_process_cannot_see_is_named():
    with pytest.raises(ValueError, match=r"trainer.reference_device is 'cuda:1' but this process sees no cuda device"):
        resolve_device("cuda:1", "trainer.reference_device")
    with pytest.raises(ValueError, match=r"trainer.device is 'npu' but this process sees no npu device"):
        resolve_device("npu")


def test_a_malformed_device_is_refused():
    with pytest.raises(ValueError, match=r"trainer.device is 'gpu', not a torch device"):
        resolve_device("gpu")


def test_device_problems_follow_what_the_process_sees():
    two_gpus = {"cuda": 2, "npu": 0}
    assert device_problem("cuda:1", two_gpus) is None and device_problem("cuda", two_gpus) is None
    assert device_problem("cuda:2", two_gpus) == "this process sees 2 cuda device(s), cuda:0 to cuda:1"
    assert device_problem("npu", two_gpus) == "this process sees no npu device; use 'auto' or 'cpu'"
    assert device_problem("npu:0", {"cuda": 0, "npu": 8}) is None
    assert device_problem("cpu", two_gpus) is None


def test_local_placement_gives_the_trainer_one_device_and_each_worker_its_own():
    from tidal.devices import accelerator_placement

    assert accelerator_placement(["0"], workers=1, per_worker=1) is None  # one GPU: shared
    assert accelerator_placement(["0", "1"], workers=1, per_worker=2) is None  # tensor parallel 2 does not fit
    assert accelerator_placement(["0", "1", "2"], 2, 1) == {"trainer": ["0"], "worker-0": ["1"], "worker-1": ["2"]}
    assert accelerator_placement(list("01234"), 2, 2) == {"trainer": ["0"], "worker-0": ["1", "2"], "worker-1": ["3", "4"]}
    assert accelerator_placement(["0", "1", "2"], 3, 1) == {"trainer": ["0"], "worker-0": ["1"], "worker-1": ["2"], "worker-2": ["1"]}
    # two trainer ranks: one device each, then the workers
    assert accelerator_placement(list("0123"), 2, 1, trainer_ranks=2) == {"trainer": ["0", "1"], "worker-0": ["2"], "worker-1": ["3"]}
    assert accelerator_placement(["0", "1"], 1, 1, trainer_ranks=2) is None  # no device left for a worker: shared


def test_visible_device_ids_follow_the_parents_list():
    from tidal.devices import visible_device_ids

    assert visible_device_ids("cuda", {"CUDA_VISIBLE_DEVICES": "4, 6"}, 2) == ["4", "6"]
    assert visible_device_ids("cuda", {}, 3) == ["0", "1", "2"]
    assert visible_device_ids("npu", {"ASCEND_RT_VISIBLE_DEVICES": "2"}, 1) == ["2"]


def test_vllm_on_cpu_sizes_each_engines_kv_cache_from_the_memory_available():
    from tidal.config import config_from_dict
    from tidal.rollout.vllm_args import cpu_kv_cache_bytes, engines_on_this_machine, start_failure_hint

    gib = 2**30
    assert cpu_kv_cache_bytes(20 * gib, 2) == int(20 * gib * 0.4 / 2)  # two engines share 40% of what is free
    assert cpu_kv_cache_bytes(512 * gib, 1) == 8 * gib and cpu_kv_cache_bytes(gib // 4, 4) == 2**28  # clamped
    cfg = config_from_dict({"rollout": {"engine": "vllm", "workers": 3}, "eval": {"every": 5}})
    assert engines_on_this_machine(cfg) == 4  # the held-out curve's engine too
    hint = start_failure_hint(ValueError("Available memory on node 0 is less than desired CPU memory utilization\nmore"), "cpu")
    assert hint.startswith("the vLLM engine did not start on cpu: Available memory on node 0") and "rollout.vllm.kv_cache_memory_gib" in hint

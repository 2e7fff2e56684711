"""The hybrid engine (OpenRLHF's colocate_all_models in sync mode): the layouts it accepts and refuses, the order of a
step's sleep, train, sync and wake, and weights exact after a sync through shared memory."""

import pytest

from conftest import preset_config
from openrlhf_async.config import ConfigError

HYBRID = ("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep", "--vllm.num_engines", "2",
          "--actor.num_gpus_per_node", "2")


def test_the_hybrid_layout_is_accepted_in_sync_mode_with_openrlhfs_old_spellings_too(capsys):
    cfg = preset_config(*HYBRID)
    assert cfg.hybrid and cfg.mode == "sync" and cfg.vllm.enable_sleep and cfg.ds.enable_sleep
    old = preset_config("--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
                        "--colocate_actor_ref", "--vllm_num_engines", "2", "--actor_num_gpus_per_node", "2")
    assert old.hybrid and old.vllm.enable_sleep and old.ds.enable_sleep and old.train.colocate_actor_ref
    # In the async modes --train.colocate_all keeps its meaning there (the DeepSpeed models only): no hybrid engine.
    assert not preset_config("--train.colocate_all", "--train.async_enable").hybrid


def test_openrlhf_0_10_spelling_of_the_correction_switch_is_translated():
    cfg = preset_config("--vllm_enable_is_correction", "--vllm_is_correction_type", "icepop")
    assert (cfg.algo.is_correction_level, cfg.algo.is_correction_mode) == ("token", "mask")


@pytest.mark.parametrize("flags, message", [
    (("--train.colocate_all", "--vllm.num_engines", "1", "--actor.num_gpus_per_node", "2"),
     "--train.colocate_all: --vllm.num_engines 1 x --vllm.tensor_parallel_size 1 (1) must equal --actor.num_nodes 1 "
     "x --actor.num_gpus_per_node 2 (2)"),
    (("--train.async_enable", "--vllm.enable_sleep"),
     "--vllm.enable_sleep with --mode async: the asynchronous modes keep the engines on devices of their own"),
    (("--mode", "fully_async", "--vllm.enable_sleep"), "--vllm.enable_sleep with --mode fully_async"),
    (HYBRID + ("--ds.zero_stage", "0"), "--ds.enable_sleep with --ds.zero_stage 0: DeepSpeed offloads the states of "
                                        "a ZeRO optimizer only"),
    (HYBRID + ("--vllm.max_num_engines", "3"), "--vllm.max_num_engines 3 with --train.colocate_all"),
])
def test_a_refused_hybrid_layout_is_one_line_naming_the_flags_and_the_fix(flags, message):
    with pytest.raises(ConfigError) as e:
        preset_config(*flags)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text, text
    assert "drop" in text or "use" in text or "change" in text, text


@pytest.mark.parametrize("flags, message", [
    (("--vllm.enable_sleep", "--ds.enable_sleep"),
     "--vllm.enable_sleep and --ds.enable_sleep has no effect without --train.colocate_all"),
    (HYBRID + ("--ds.adam_offload",), "--ds.enable_sleep has no effect with --ds.adam_offload"),
])
def test_sleep_flags_without_anything_to_free_run_with_one_notice(flags, message, capsys):
    preset_config(*flags)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == 1 and notices[0].startswith("notice: " + message), notices


def test_the_hybrid_engine_counts_the_trainers_gpus_once():
    from openrlhf_async.cli.train_async import resources

    cfg = preset_config(*HYBRID)
    cfg.device = "cuda"
    assert resources(cfg)["gpus"] == 2
    cfg.train.colocate_all = False
    assert resources(cfg)["gpus"] == 4

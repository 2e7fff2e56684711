"""Every ZeRO stage trains, with and without a frozen reference model and optimizer offload: OpenRLHF's own defaults
(ZeRO-2 and a KL against the reference model) through the real CLI, and each stage's step on the policy's ranks."""

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from openrlhf_async.config import preset_path


def test_openrlhfs_defaults_zero_2_with_a_reference_model_train_and_save_a_model(tmp_path, tiny_model_path):
    """The tests' preset sets ZeRO-3 and no KL; OpenRLHF's defaults put back: --ds.zero_stage 2 and
    --algo.kl.init_coef 0.01, which loads the reference model."""
    cmd = [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
           "--ds.zero_stage", "2", "--algo.kl.init_coef", "0.01", "--actor.model_name_or_path", tiny_model_path,
           "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
           "--rollout.vllm_generate_batch_size", "8", "--train.max_steps", "1", "--eval.steps", "-1",
           "--runs_dir", str(tmp_path / "runs"), "--run_name", "zero2", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "zero2"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1]
    assert all(math.isfinite(steps[0][k]) for k in ("loss", "kl", "grad_norm")), steps[0]
    saved = load_file(str(run_dir / "final_hf" / "model.safetensors"))
    initial = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    assert set(saved) == set(initial) and any(not saved[k].equal(initial[k]) for k in initial), "nothing trained"


SAMPLES = [{"prompt_ids": [3, 20 + i, 21, 4], "response_ids": [20 + i % 3, 21 + i % 2, 22, 23], "logprobs": [-2.0] * 4,
            "advantage": (1.0, -1.0, 0.5, -0.5)[i], "action_mask": [1, 1, 1, 1]} for i in range(4)]
WEIGHT = "model.layers.0.mlp.down_proj.weight"


# Beside the CLI run above (ZeRO-2 with a reference model, no offload) and the other tests' shared ZeRO-3 policy (no
# reference model, no offload): every stage, the reference model under both configs it can get (stage 0 and stage 3),
# and optimizer offload under every stage that has a ZeRO optimizer (1 to 3).
@pytest.mark.parametrize("stage, reference, offload", [
    pytest.param(0, True, False, id="zero0-ref"),
    pytest.param(1, False, True, id="zero1-offload", marks=pytest.mark.long),
    pytest.param(2, True, True, id="zero2-ref-offload", marks=pytest.mark.long),
    pytest.param(3, True, True, id="zero3-ref-offload", marks=pytest.mark.long),  # CPU Adam: 110 s to build
])
def test_each_zero_stage_trains_a_step_beside_a_frozen_reference_model_and_saves_and_restores_it(
        ray_cluster, tiny_model_path, tmp_path, stage, reference, offload):
    """On 2 ranks: the reference model scores as the policy did before the step and still does after it; the step
    moves the weights; the full weights read, saved and restored are the policy's under every stage."""
    from conftest import preset_config
    from openrlhf_async.trainer.ranks import PolicyGroup, loss_settings
    from openrlhf_async.utils.ray_utils import get_all

    flags = ["--ds.zero_stage", str(stage)]
    flags += ["--algo.kl.init_coef", "0.01"] if reference else []
    flags += ["--ds.adam_offload", "--ref.offload"] if offload else []
    cfg = preset_config(*flags)
    policy = PolicyGroup(cfg, tiny_model_path)

    def weight():
        return get_all(policy.call("read_weight", WEIGHT))[0]

    try:
        start = str(tmp_path / "start")
        get_all(policy.call("save_checkpoint", start))
        before, weight_before = policy.logprobs(SAMPLES, 1.0), weight()
        if reference:
            ref_before = policy.logprobs(SAMPLES, 1.0, reference=True)
            assert ref_before == before, "the reference model is the initial policy"
        stats = policy.train_step(SAMPLES, 2, loss_settings(cfg))
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and math.isfinite(stats["kl"]), stats
        trained = weight()
        assert not trained.equal(weight_before) and policy.logprobs(SAMPLES, 1.0) != before
        if reference:
            assert policy.logprobs(SAMPLES, 1.0, reference=True) == ref_before, "the reference model moved"
        get_all(policy.call("save_hf", str(tmp_path / "hf")))
        saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
        initial = load_file(os.path.join(tiny_model_path, "model.safetensors"))
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in initial.items()}
        assert saved[WEIGHT].equal(trained)
        get_all(policy.call("load_checkpoint", start))
        assert weight().equal(weight_before)
    finally:
        policy.shutdown()


@pytest.mark.parametrize("flags", [
    pytest.param(["--ds.zero_stage", "2", "--algo.kl.init_coef", "0.01"], id="openrlhf-defaults"),
    pytest.param(["--ds.zero_stage", "0", "--algo.kl.init_coef", "0.01"], id="zero0-ref"),
    pytest.param(["--ds.zero_stage", "1", "--ds.adam_offload"], id="zero1-offload"),
    pytest.param(["--ds.zero_stage", "3", "--algo.kl.init_coef", "0.01", "--ref.offload", "--ds.adam_offload"],
                 id="zero3-ref-offload"),
])
def test_a_dry_run_accepts_every_stage_with_or_without_reference_model_and_offload(tmp_path, capsys, flags):
    from openrlhf_async.cli.train_async import main

    assert main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--dry_run", *flags]) == 0
    out = capsys.readouterr().out
    ds = json.loads(out[: out.rindex("\ndry run:")])["config"]["ds"]
    assert ds["zero_stage"] == int(flags[1]) and ds["adam_offload"] == ("--ds.adam_offload" in flags)


def test_optimizer_offload_without_a_zero_optimizer_is_refused_in_one_line_naming_the_flags(tmp_path, capsys):
    """ZeRO-Offload moves the ZeRO optimizer's state; stage 0 has none, and DeepSpeed's CPU Adam would then meet
    parameters on the GPU at the first step."""
    from openrlhf_async.cli.train_async import main

    flags = ["--ds.zero_stage", "0", "--ds.adam_offload", "--dry_run", "--runs_dir", str(tmp_path / "runs")]
    assert main(["@" + preset_path("tiny_cpu"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --ds.adam_offload needs --ds.zero_stage 1, 2 or 3") and len(err.splitlines()) == 1, err

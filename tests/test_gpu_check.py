"""`make gpu-check` on CPU (--device cpu --shape tiny): the trainer's real ZeRO-3 step on gloo in fp32, packed rows
against padded rows, as the GPU machine runs it on NCCL in bf16 for real shapes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.mark.long  # the trainer's step it runs is the one every training test runs; its GPU run is `make gpu-check`
def test_the_cpu_variant_prints_one_json_line_with_matching_gradients_peak_memory_and_step_time():
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--shape", "tiny", "--sleep"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-3000:]
    result = json.loads(lines[0])
    assert (result["device"], result["dtype"], result["zero_stage"], result["gpu"]) == ("cpu", "fp32", 3, None)
    tiny = result["shapes"]["tiny"]
    assert tiny["grads_match"] and tiny["grad_norm_packed"] > 0, tiny
    assert tiny["grad_norm_rel_diff"] < 1e-4 and tiny["min_grad_cosine"] > 0.9999, tiny
    assert tiny["peak_gb"] > 0 and tiny["step_s_packed"] > 0 and tiny["step_s_padded"] > 0, tiny
    assert tiny["tokens"] > tiny["samples"] > 0 and tiny["planned_gb"] > 0, tiny
    # --sleep: the hybrid engine's offload and reload of the training states, then a step reaching the same gradients
    assert tiny["wake_matches"] and tiny["after_wake_grad_norm_rel_diff"] < 1e-6 and len(tiny["offload_s"]) == 2, tiny


BROKEN_PACKING = """
import json, sys, torch
sys.path.insert(0, "benchmarks")
from openrlhf_async.trainer import batching
of = batching.Layout.of.__func__

def positions_not_restarted(cls, samples, packed):
    layout = of(cls, samples, packed)
    if packed:  # one sequence to the model: attention crosses the samples
        layout.position_ids = torch.arange(layout.ids.shape[1]).unsqueeze(0)
    return layout

batching.Layout.of = classmethod(positions_not_restarted)
import gpu_check
print(json.dumps(gpu_check.check_shape("tiny", "cpu", "fp32", gpu_check.WORKLOADS["cpu"], 0)))
"""


def test_the_check_fails_where_packed_rows_let_attention_cross_samples():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", BROKEN_PACKING], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tiny = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not tiny["grads_match"] and tiny["min_grad_cosine"] < 0.99, tiny


def test_missing_packages_without_wheels_give_one_line_naming_the_make_target(capsys, monkeypatch, tmp_path):
    import gpu_check

    monkeypatch.setattr(gpu_check, "REQUIRED", ("deepspeed", "no_such_package_gpu_check"))
    assert gpu_check.main(["--device", "cpu", "--wheels", str(tmp_path / "none")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("gpu-check: no_such_package_gpu_check missing") and "make gpu-wheels" in out, out
    assert len(out.splitlines()) == 1


def test_architecture_specific_arch_lists_are_read_as_plain_capabilities_for_deepspeeds_builder(monkeypatch):
    """An H200 image's TORCH_CUDA_ARCH_LIST=9.0a killed FusedAdam's build (DeepSpeed parses each entry as numbers)."""
    from openrlhf_async.trainer.rank import jit_arch_list

    for given, read in (("9.0a", "9.0"), ("8.0 9.0a+PTX", "8.0;9.0+PTX"), ("9.0;10.0a;10.0", "9.0;10.0"),
                        ("9.0+PTX", "9.0+PTX")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
        jit_arch_list()
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == read, given
        assert all(int(n) >= 0 for cc in read.split(";") for n in cc.split("+")[0].split("."))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    jit_arch_list()
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ

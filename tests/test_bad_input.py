"""Bad input fails fast with one line naming the flag or file, before any actor starts."""

import json
import os
import subprocess
import sys

import pytest

from openrlhf_async.cli.train_async import main
from openrlhf_async.config import preset_path, settings


def run_cli(tmp_path, *flags):
    """The command with the tests' preset (the demo's settings) and flags."""
    return main(["@" + preset_path("tiny_cpu"), "--runs_dir", str(tmp_path / "runs"), "--no-progress", *flags])


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--actor.model_name_or_path", "/no/such/model"], "--actor.model_name_or_path /no/such/model: no such model folder"),
        (["--data.prompt_dataset", "/no/such.jsonl"], "--data.prompt_dataset /no/such.jsonl: no such file"),
        (["--rollout.n_samples_per_prompt", "0"], "--rollout.n_samples_per_prompt 0: must be at least 1"),
        (["--vllm.num_engines", "0"], "--vllm.num_engines 0: give at least 1"),
        (["--rollout.max_new_tokens", "300"], "--rollout.max_new_tokens 300 must be below --data.max_len"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "1", "--train.colocate_all",
          "--vllm.num_engines", "2"],
         "--train.colocate_all puts --critic's models on --actor's devices, one to one"),
        (["--algo.advantage.estimator", "gae", "--critic.num_gpus_per_node", "64"],
         "--critic.num_nodes 1 x --critic.num_gpus_per_node 64: 64 critic ranks on cpu need a core each"),
        (["--algo.advantage.estimator", "ppo"], "argument --algo.advantage.estimator: invalid choice: 'ppo'"),
        (["--agent.step_timeout", "0"], "--agent.step_timeout 0.0: must be above 0"),
        (["--algo.dynamic_filtering_range", "1", "0"], "--algo.dynamic_filtering_range 1.0 0.0: the low end"),
        (["--reward.overlong_buffer_len", "8"], "--reward.overlong_buffer_len 8 must be below the response budget"),
        (["--train.agent_func_path", "/no/agent.py"], "--train.agent_func_path /no/agent.py: no such file"),
        (["--mode", "overlapped"], "argument --mode: invalid choice: 'overlapped'"),
        (["--train.async_queue_size", "0"], "--train.async_queue_size 0 (or OPENRLHF_ASYNC_QUEUE_SIZE): must be at"),
        (["--train.max_staleness", "-2"], "--train.max_staleness -2: must be 0 or more"),
        (["--train.staleness_threshold", "-0.5"], "--train.staleness_threshold -0.5: must not be negative"),
        (["--train.partial_rollout_enable"], "--train.partial_rollout_enable needs --train.async_enable"),
        (["--train.require_batches", "2"], "--train.require_batches only apply to --mode fully_async (got --mode sync)"),
        (["--mode", "async", "--train.async_queue_size", "2", "--train.max_staleness", "1"],
         "--train.max_staleness 1 is below --train.async_queue_size 2"),
        (["--train.max_staleness", "2"], "--train.max_staleness 2 contradicts --mode sync"),
        (["--algo.advantage.is_correction_mode", "vtrace"],
         "argument --algo.advantage.is_correction_mode: invalid choice: 'vtrace'"),
        (["--algo.advantage.is_correction_threshold", "2", "0.5"],
         "--algo.advantage.is_correction_threshold 2.0 0.5: give HIGH or LOW HIGH with LOW <= HIGH"),
        (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
         "--algo.advantage.is_correction_mode clip clamps the token ratio"),
        (["--reward.remote_url", "ftp://host/score"], "--reward.remote_url ftp://host/score: give http(s)://"),
        (["--reward.remote_url", "/no/reward.py"], "--reward.remote_url /no/reward.py: no such file"),
        (["--reward.timeout", "0"], "--reward.timeout 0.0: must be above 0 seconds"),
        (["--reward.max_error_ratio", "2"], "--reward.max_error_ratio 2.0: must be in [0, 1]"),
        (["--rollout.skip_flat_prompts", "1"], "--rollout.skip_flat_prompts 1.0: must be in [0, 1)"),
        (["--rollout.screen_samples", "8"], "--rollout.screen_samples 8: use 0 (off) or a number from 2 to "
                                            "--rollout.n_samples_per_prompt - 1 (7)"),
        (["--rollout.screen_samples", "1"], "--rollout.screen_samples 1: use 0 (off) or a number from 2"),
        (["--rollout.screen_samples", "4", "--no-algo.dynamic_filtering_enable"],
         "--rollout.screen_samples 4 drops groups that would be flat, which only makes sense with dynamic sampling"),
        (["--reward.stop_properly_penalty_coef", "2"], "--reward.stop_properly_penalty_coef 2.0: must not be above 1"),
        (["--actor.dual_clip", "0.5"], "--actor.dual_clip 0.5: must be above 1"),
        (["--algo.kl.init_coef", "0.01", "--algo.advantage.estimator", "reinforce_baseline"],
         "--algo.kl.init_coef 0.01 without --algo.kl.use_loss puts the KL in the reward"),
        (["--reward.workers", "0"], "--reward.workers 0: must be at least 1"),
        (["--eval.n_samples_per_prompt", "4"], "--eval.n_samples_per_prompt 4 with --eval.temperature 0 draws"),
        (["--eval.max_new_tokens", "256"], "--eval.max_new_tokens 256 must be below --data.max_len 256"),
        (["--actor.model_name_or_path", "./no/model"], "--actor.model_name_or_path ./no/model: no such model folder"),
        (["--logger.wandb_mode", "sometimes"], "argument --logger.wandb_mode: invalid choice: 'sometimes'"),
        (["--ckpt.save_steps", "0"], "--ckpt.save_steps 0: use -1 (never) or a number of steps from 1"),
        (["--eval.steps", "0"], "--eval.steps 0: use -1 (never) or a number of steps from 1"),
        (["--mode", "fully_async", "--train.trigger_parameter_sync_step", "2", "--ckpt.save_steps", "3"],
         "--ckpt.save_steps 3 must be a multiple of --train.trigger_parameter_sync_step 2"),
    ],
)
def test_bad_flag_values(tmp_path, capsys, flags, expected):
    assert run_cli(tmp_path, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_bad_dataset_files(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_label = tmp_path / "no_label.jsonl"
    no_label.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "label": "2"}\n{not json\n')
    cases = [(empty, "the dataset is empty"), (no_label, "row 0 has no 'prompt' or 'label' field"),
             (broken, "line 2 is not valid JSON")]
    for path, expected in cases:
        assert run_cli(tmp_path, "--data.prompt_dataset", str(path)) == 2
        err = capsys.readouterr().err.strip()
        assert f"--data.prompt_dataset {path}: {expected}" in err and len(err.splitlines()) == 1, err


def test_unknown_flag_is_rejected_by_the_real_command():
    proc = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", "--vllm.num_engine", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --vllm.num_engine" in proc.stderr


def test_help_lists_openrlhf_flag_names():
    proc = subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for flag in ("--vllm.num_engines", "--rollout.n_samples_per_prompt", "--actor.adam.lr", "--eval.steps",
                 "--algo.advantage.estimator", "--data.prompt_dataset"):
        assert flag in proc.stdout
    first_screen = proc.stdout.splitlines()[:30]  # a short usage line, the description and the sections
    assert first_screen[0].startswith("usage: ") and len(first_screen[0]) < 120
    assert "  rollout  generation: samples per prompt, budgets, early stop" in first_screen
    assert "  --actor.adam.lr X     [OpenRLHF] Adam learning rate" in proc.stdout  # OpenRLHF's flags are marked
    assert "  --rollout.early_stop, --no-rollout.early_stop\n                        stop the rollout" in proc.stdout


def test_help_of_one_section_shows_its_flags_and_an_unknown_one_is_one_line():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "openrlhf_async.cli.train_async", *args], capture_output=True,
                              text=True, timeout=120)

    rollout = run("--help", "rollout")
    flags = [line.split()[0].rstrip(",") for line in rollout.stdout.splitlines() if line.startswith("  --")]
    assert rollout.returncode == 0 and flags and all(flag.startswith("--rollout.") for flag in flags), rollout.stdout
    assert "--rollout.n_samples_per_prompt" in flags and "--actor.adam.lr" not in rollout.stdout
    adam = run("--help", "actor.adam")
    assert [line.split()[0] for line in adam.stdout.splitlines() if line.startswith("  --")] == [
        "--actor.adam.lr", "--actor.adam.betas", "--actor.adam.eps", "--actor.adam.weight_decay"], adam.stdout
    unknown = run("--help", "rollouts")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "error: --help rollouts: no flag starts with --rollouts; sections: run, actor, rollout, vllm, train, algo, "
        "data, eval, reward, agent, ds, ref, critic, ckpt, logger, plan"], unknown.stderr


AGENT_FILES = {
    "broken.py": ("def step(state, action, label) return 1", "does not import (SyntaxError"),
    "empty.py": ("x = 1\n", "defines none of step, AgentExecutor and run"),
    "two_args.py": ("def step(state, action):\n    return 0, state, True, {}\n", "step takes 2 arguments"),
    "not_openrlhf.py": ("class AgentExecutor:\n    pass\n", "AgentExecutor must subclass"),
}


@pytest.mark.parametrize("name", sorted(AGENT_FILES))
def test_bad_agent_files_fail_at_start_naming_the_file_and_contract(tmp_path, capsys, name):
    body, expected = AGENT_FILES[name]
    path = tmp_path / name
    path.write_text(body)
    assert run_cli(tmp_path, "--train.agent_func_path", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert f"--train.agent_func_path {path}" in err and expected in err and len(err.splitlines()) == 1, err


def test_a_step_returning_the_wrong_shape_is_reported_as_a_contract_error():
    from openrlhf_async.agent import AgentStepError, check_step_result

    assert check_step_result((1, "s", True, None)).reward == 1.0
    for bad, expected in [(1.0, "expected a tuple"), ((None, "s", True, {}), "expected a number"),
                          ((1.0, 5, True, {}), "next_state of type int")]:
        with pytest.raises(AgentStepError, match=expected):
            check_step_result(bad)


def test_queue_size_from_the_environment_is_honoured_and_checked(tmp_path, capsys, monkeypatch):
    from openrlhf_async.config import parse_config

    monkeypatch.setenv("OPENRLHF_ASYNC_QUEUE_SIZE", "3")
    assert parse_config(["--mode", "async"]).queue_size == 3
    monkeypatch.setenv("OPENRLHF_ASYNC_QUEUE_SIZE", "0")
    assert run_cli(tmp_path, "--mode", "async") == 2
    assert "OPENRLHF_ASYNC_QUEUE_SIZE): must be at least 1" in capsys.readouterr().err


def _fake_checkpoint(ckpt, step, **data):
    """What trainer/checkpoint.py leaves: step_<N>/trainer_state.json (the DeepSpeed files are not read here)."""
    (ckpt / f"step_{step}").mkdir(parents=True)
    state = {"step": step, "weight_version": step, "eval_start": None, "data_position": {"frontier": 0, "done": []},
             "data": {"num_prompts": 1618, "seed": 42, **data}}
    (ckpt / f"step_{step}" / "trainer_state.json").write_text(json.dumps(state))


def test_checkpoints_that_cannot_continue_the_run_are_refused_before_anything_starts(tmp_path, capsys):
    ckpt = tmp_path / "runs" / "run" / "ckpt"
    _fake_checkpoint(ckpt, 4)
    (ckpt / "step_6.partial").mkdir()  # cut short by a kill: never resumed from
    assert run_cli(tmp_path, "--ckpt.save_steps", "2") == 2
    assert "holds checkpoints of an earlier run (newest: step 4): pass --ckpt.load_enable" in capsys.readouterr().err
    assert run_cli(tmp_path, "--ckpt.load_enable", "--train.max_steps", "4") == 2
    assert "has trained 4 steps already; raise --train.max_steps (now 4)" in capsys.readouterr().err
    assert run_cli(tmp_path, "--ckpt.load_enable", "--train.seed", "7") == 2
    assert "with --train.seed 42, this run has 1618 and 7; resume with the same" in capsys.readouterr().err
    assert run_cli(tmp_path, "--ckpt.load_enable", "--dry_run") == 0
    report = json.loads(capsys.readouterr().out.rsplit("\ndry run:", 1)[0])
    assert report["resume_from"] == {"path": str(ckpt / "step_4"), "step": 4}


def dry_run(tmp_path, *flags):
    """A dry run of the CLI, in process: it validates everything a run would and starts nothing."""
    return run_cli(tmp_path, "--dry_run", *flags)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--train.staleness_threshold", "nan"], "--train.staleness_threshold nan: must be a finite number"),
        (["--actor.adam.lr", "inf"], "--actor.adam.lr inf: must be a finite number"),
        (["--algo.advantage.is_correction_threshold", "0.5", "inf"],
         "--algo.advantage.is_correction_threshold 0.5 inf: must be a finite number"),
        (["--algo.dynamic_filtering_range", "nan", "1"], "--algo.dynamic_filtering_range nan 1.0: must be a finite"),
        (["--actor.adam.betas", "0.9", "1"], "--actor.adam.betas 0.9 1.0: each must be in [0, 1)"),
        (["--actor.adam.betas", "-0.1", "0.95"], "--actor.adam.betas -0.1 0.95: each must be in [0, 1)"),
        (["--actor.adam.weight_decay", "-0.1"], "--actor.adam.weight_decay -0.1: must not be negative"),
        (["--actor.max_norm", "-1"], "--actor.max_norm -1.0: must not be negative"),
        (["--vllm.gpu_memory_utilization", "1.5"], "--vllm.gpu_memory_utilization 1.5: must be in (0, 1]"),
        (["--algo.dynamic_filtering_std_eps", "0"], "--algo.dynamic_filtering_std_eps 0.0: must be above 0"),
        (["--run_name", ".."], "--run_name '..': give a plain folder name"),
        (["--run_name", "."], "--run_name '.': give a plain folder name"),
        (["--reward.remote_url", "http://"], "--reward.remote_url http://: the URL has no host"),
        (["--reward.remote_url", "http://:5000/score"], "--reward.remote_url http://:5000/score: the URL has no host"),
        (["--reward.remote_url", "http://host:port/score"], "--reward.remote_url http://host:port/score: not a URL"),
    ],
)
def test_bad_values_fail_a_dry_run_with_one_line(tmp_path, capsys, flags, expected):
    assert dry_run(tmp_path, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def _float_flag_defaults():
    """{flag: how many values it takes} of every float flag that has an effect, found as validation finds them
    (walking the config dataclasses)."""
    from openrlhf_async.config import float_flags, settings, support

    counts = {}
    for flag in float_flags():
        f = settings()[flag][1]
        if support(f)[0] != "no effect":
            nargs = f.metadata["nargs"]
            counts[flag] = nargs if isinstance(nargs, int) else len(f.default) if isinstance(f.default, tuple) else 1
    return counts


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_every_float_flag_rejects_nan_and_inf(tmp_path, capsys, bad):
    failed = {}
    for flag, count in _float_flag_defaults().items():
        values = [bad] * count
        code = dry_run(tmp_path, f"--{flag}", *values)
        err = capsys.readouterr().err.strip()
        if code != 2 or err != f"error: --{flag} {' '.join(map(str, map(float, values)))}: must be a finite number":
            failed[flag] = err
    assert not failed


def test_every_float_flag_has_a_range():
    assert [flag for flag in _float_flag_defaults() if not settings()[flag][1].metadata["range"]] == []


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("OPENRLHF_ASYNC_QUEUE_SIZE", "abc",
         "OPENRLHF_ASYNC_QUEUE_SIZE='abc' (the environment override of --train.async_queue_size): must be a whole"),
        ("OPENRLHF_ASYNC_NUM_TASKS", "0",
         "OPENRLHF_ASYNC_NUM_TASKS=0 (the environment override of --vllm.max_concurrency): must be at least 1"),
        ("DEVICE", "tpu", "DEVICE='tpu' (the environment default of --device): use cpu or cuda"),
    ],
)
def test_bad_environment_overrides_name_the_variable(tmp_path, capsys, monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    assert dry_run(tmp_path, "--mode", "async") == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "content, expected",
    [
        (b'{"step": 4, "weight_version"', "cannot be read (JSONDecodeError: "),
        (b"\xff\xfe\x00binary", "cannot be read (UnicodeDecodeError: "),
        (b"[4]", "is not a JSON object"),
        (json.dumps({"step": "4", "weight_version": 4, "eval_start": None, "data": {"num_prompts": 1618, "seed": 42},
                     "data_position": {"frontier": "x"}}).encode(), "has a missing or malformed step, data_position field"),
    ],
)
def test_a_corrupt_checkpoint_state_is_one_line_naming_the_file(tmp_path, capsys, content, expected):
    ckpt = tmp_path / "runs" / "run" / "ckpt"
    _fake_checkpoint(ckpt, 4)
    state = ckpt / "step_4" / "trainer_state.json"
    state.write_bytes(content)
    assert dry_run(tmp_path, "--ckpt.load_enable") == 2
    err = capsys.readouterr().err.strip()
    assert f"--ckpt.load_enable: {state} {expected}" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "line, expected",
    [
        (b'{"prompt": "1+1=", "label": "\xff\xfe"}', "line 2 is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "line 2 is nested more than 64 levels deep"),
        (b'{"prompt": "1+1=", "label": ' + b"[" * 200 + b"]" * 200 + b"}", "line 2 is nested more than 64 levels"),
        (b'{"prompt": "1+1=", "label": ' + b"9" * 5000 + b"}", "line 2 is not valid JSON (Exceeds the limit"),
    ],
)
def test_binary_or_deeply_nested_dataset_lines_are_one_line_errors(tmp_path, capsys, line, expected):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "label": "2"}\n' + line + b"\n")
    assert dry_run(tmp_path, "--data.prompt_dataset", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert f"--data.prompt_dataset {path}: {expected}" in err and len(err.splitlines()) == 1, err


HANG = "while True:\n    pass\n"
EXIT = "import os\nos._exit(0)\n"


@pytest.mark.parametrize(
    "flag, body, expected",
    [
        ("--train.agent_func_path", HANG, "did not finish importing within 3 s"),
        ("--train.agent_func_path", EXIT, "ends the Python process while importing (exit code 0;"),
        ("--reward.remote_url", EXIT, "ends the Python process while importing (exit code 0;"),
    ],
)
def test_a_user_file_that_hangs_or_exits_at_import_is_one_line(tmp_path, flag, body, expected):
    path = tmp_path / "user_file.py"
    path.write_text(body)
    # The real command, with the import timeout shortened; a hang would outlast the subprocess timeout.
    program = ("import sys; import openrlhf_async.utils.user_files as u; u.IMPORT_TIMEOUT_S = 3; "
               "from openrlhf_async.cli.train_async import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", program, "@" + preset_path("tiny_cpu"), "--dry_run", "--runs_dir",
                           str(tmp_path / "runs"), flag, str(path)], capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and f"error: {flag} {path}: {expected}" in err and len(err.splitlines()) == 1, err


MISSING_PACKAGE = """
import runpy, sys

class Missing:  # this environment without the package named first on the command line
    def find_spec(self, name, path=None, target=None):
        if name == MISSING or name.startswith(MISSING + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

MISSING, module, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
sys.meta_path.insert(0, Missing())
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("package,module,args", [
    ("torch", "openrlhf_async.cli.train_async", ["@" + preset_path("tiny_cpu"), "--dry_run",
                                                     "--runs_dir", "{tmp}"]),
    ("pyarrow", "openrlhf_async.cli.prepare_data", ["--dataset", "dapo-math-17k", "--input", "{tmp}/x.parquet",
                                                    "--output", "{tmp}/out"]),
])
def test_a_missing_package_is_one_line_saying_to_run_make_install(tmp_path, package, module, args):
    (tmp_path / "x.parquet").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    # No DEVICE (make test sets it): the device is then found with torch, which the dry run must import.
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    proc = subprocess.run([sys.executable, "-c", MISSING_PACKAGE, package, module, *args], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"error: the Python package '{package}' is missing from {sys.executable}'s environment: run `make install` "
        "and use .venv/bin/python"], proc.stderr


def test_a_missing_module_of_this_package_is_a_bug_shown_with_its_traceback_not_a_call_to_make_install():
    proc = subprocess.run([sys.executable, "-c", MISSING_PACKAGE, "openrlhf_async.errors",
                           "openrlhf_async.cli.train_async", "--dry_run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "make install" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("ModuleNotFoundError: No module named 'openrlhf_async.errors'"), proc.stderr


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0+cpu"])
def test_a_vllm_outside_the_supported_range_is_refused_in_one_line_naming_it(tmp_path, capsys, monkeypatch,
                                                                            release):
    from openrlhf_async.config import probes

    monkeypatch.setattr(probes, "vllm_release", lambda: release)
    assert run_cli(tmp_path, "--dry_run") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: vLLM {release} is installed; this project runs on vLLM 0.26 to 0.32 (`make install` "
                   "installs 0.32.0; `make test-vllm VLLM=...` checks another release)"), err


def test_the_installed_vllm_is_in_the_supported_range():
    from openrlhf_async.config.probes import check_vllm_release, vllm_release

    assert vllm_release() is not None
    check_vllm_release(vllm_release())

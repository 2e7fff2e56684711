"""What the model wrote reaches samples.jsonl, TensorBoard text and a W&B table: decoded turn by turn, with its
label, prediction, reward and weight versions; the trainer sends the first --logger.log_samples groups and
evaluation answers; a resumed run cuts the record back to its checkpoint and --overwrite deletes it."""

import glob
import json
import os

import pytest

from conftest import NO_POLICY
from stand_in_sync import StandInSync
from openrlhf_async.config import Config, LoggerConfig
from openrlhf_async.rollout.episode import Episode
from openrlhf_async.utils.metrics import MetricsLog
from openrlhf_async.utils.samples import TEXT_CHARS, SampleText



@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def prompt(tokenizer, question: str, label: str) -> dict:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return {"prompt_ids": list(ids), "label": label}


def single_turn(tokenizer, p: dict, answer: str, request_id: str = "g3-0", version: int = 2) -> Episode:
    ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    score = float(answer == p["label"])
    return Episode(request_id, p["prompt_ids"], response_ids=ids, logprobs=[-0.5] * len(ids),
                   action_mask=[1] * len(ids), token_versions=[version] * len(ids), finish_reason="stop", score=score,
                   reward=score, turns=1, extra_info={"accuracy": score, "pred": answer})


def multi_turn(tokenizer, p: dict) -> Episode:
    """A tool call written at version 4, the tool's answer, then the final answer written at version 5."""
    call, result, final = (tokenizer.encode(text, add_special_tokens=False) for text in ("calc(2*3)", "=6", "6"))
    final += [tokenizer.eos_token_id]
    return Episode("g7-1", p["prompt_ids"], response_ids=call + result + final,
                   logprobs=[-0.1] * len(call) + [0.0] * len(result) + [-0.2] * len(final),
                   action_mask=[1] * len(call) + [0] * len(result) + [1] * len(final),
                   token_versions=[4] * (len(call) + len(result)) + [5] * len(final), finish_reason="stop",
                   score=1.0, reward=0.9, turns=2, extra_info={"pred": "6"})


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [prompt(tokenizer, "12+34=", "46"), prompt(tokenizer, "2*3=", "6")]


def test_a_single_turn_sample_is_decoded_with_its_label_and_versions(tokenizer, prompts):
    row = SampleText(tokenizer, prompts).row(5, "train", single_turn(tokenizer, prompts[0], "46"))
    assert row == {"step": 5, "kind": "train", "group": "g3", "prompt": "<|user|>12+34=<|assistant|>",
                   "turns": [{"response": "46<|endoftext|>", "observation": ""}], "label": "46", "pred": "46",
                   "reward": 1.0, "score": 1.0, "finish_reason": "stop", "weight_version_min": 2,
                   "weight_version_max": 2, "error": None}


def test_a_multi_turn_sample_keeps_each_response_and_observation(tokenizer, prompts):
    row = SampleText(tokenizer, prompts).row(1, "train", multi_turn(tokenizer, prompts[1]))
    assert row["turns"] == [{"response": "calc(2*3)", "observation": "=6"},
                            {"response": "6<|endoftext|>", "observation": ""}]
    assert (row["label"], row["pred"], row["reward"], row["score"]) == ("6", "6", 0.9, 1.0)
    assert (row["weight_version_min"], row["weight_version_max"]) == (4, 5)


def test_long_texts_keep_their_start_and_end(tokenizer, prompts):
    ep = single_turn(tokenizer, prompts[0], "1" * 3 * TEXT_CHARS + "46")
    ep.error, ep.extra_info["pred"] = ("error", "ValueError: bad answer"), {"tests": ["assert f(1) == 2"] * 1000}
    row = SampleText(tokenizer, prompts[1:]).row(1, "train", ep)  # a prompt the log was not given: no label
    response = row["turns"][0]["response"]
    assert len(response) < TEXT_CHARS + 40 and response.startswith("111") and response.endswith("46<|endoftext|>")
    assert "chars cut" in response and row["label"] is None and row["error"] == "ValueError: bad answer"
    assert row["pred"].startswith('{"tests": ["assert f(1) == 2", ') and len(row["pred"]) < TEXT_CHARS + 40


def steps(tokenizer, prompts) -> list:
    """What the trainer sends: the evaluation before training, two training steps, the second with an evaluation."""
    group = [single_turn(tokenizer, prompts[0], "46", "g1-0"), single_turn(tokenizer, prompts[0], "45", "g1-1")]
    answer = single_turn(tokenizer, prompts[0], "46", "g0-0", version=0)
    return [{"step": 0, "eval/accuracy": 1.0, "_samples": {"train": [], "eval": [answer]}},
            {"step": 1, "reward/mean": 0.5, "_samples": {"train": group + [multi_turn(tokenizer, prompts[1])],
                                                          "eval": []}},
            {"step": 2, "reward/mean": 0.5, "eval/accuracy": 0.0,
             "_samples": {"train": group, "eval": [single_turn(tokenizer, prompts[0], "44", "g9-0", version=2)]}}]


def read_samples(run_dir: str) -> list:
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def backends(tensorboard: bool = False, wandb_mode: str = None) -> LoggerConfig:
    """The extra backends MetricsLog reads off the LoggerConfig."""
    logger = LoggerConfig()
    logger.tensorboard_dir = "{run_dir}/tensorboard" if tensorboard else None
    logger.use_wandb, logger.wandb_mode = wandb_mode is not None, wandb_mode or ""
    return logger


def test_samples_reach_the_jsonl_record_tensorboard_and_the_console(tmp_path, tokenizer, prompts, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 2, progress=False, logger=backends(tensorboard=True),
                     samples=SampleText(tokenizer, prompts))
    for metrics in steps(tokenizer, prompts):
        log.log(metrics)
    log.close()

    rows = read_samples(run_dir)
    assert [(r["step"], r["kind"], r["group"]) for r in rows] == [
        (0, "eval", "g0"), (1, "train", "g1"), (1, "train", "g1"), (1, "train", "g7"), (2, "train", "g1"),
        (2, "train", "g1"), (2, "eval", "g9")]
    assert [r["turns"][-1]["response"] for r in rows[1:3]] == ["46<|endoftext|>", "45<|endoftext|>"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert all("_samples" not in json.loads(line) for line in f)

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
             for tag in ("train/generated_samples/text_summary", "eval/generated_samples/text_summary")}
    assert [s for s, _ in texts["train/generated_samples/text_summary"]] == [1, 2]
    assert [s for s, _ in texts["eval/generated_samples/text_summary"]] == [0, 2]
    step1 = texts["train/generated_samples/text_summary"][0][1]
    assert "    [prompt] <|user|>2*3=<|assistant|>" in step1 and "    [observation 1] =6" in step1
    assert "    g7  reward 0.9  score 1  label 6  pred 6  finish stop  versions 4-5" in step1

    printed = capsys.readouterr().out.splitlines()
    assert printed == ["eval answer (step 0): <|user|>12+34=<|assistant|> => 46<|endoftext|> | label 46 | reward 1",
                       "eval answer (step 2): <|user|>12+34=<|assistant|> => 44<|endoftext|> | label 46 | reward 0"]


def test_a_resumed_run_cuts_the_samples_back_to_its_checkpoint(tmp_path, tokenizer, prompts):
    run_dir = str(tmp_path / "run")
    killed = MetricsLog(run_dir, 2, progress=False, samples=SampleText(tokenizer, prompts))
    for metrics in steps(tokenizer, prompts):
        killed.log(metrics)
    killed.close()
    with open(os.path.join(run_dir, "samples.jsonl"), "a") as f:
        f.write('{"step": 3, "kind": "tr')  # cut short by the kill

    resumed = MetricsLog(run_dir, 2, progress=False, samples=SampleText(tokenizer, prompts), resume_step=1)
    resumed.log({"step": 2, "_samples": {"train": [multi_turn(tokenizer, prompts[1])], "eval": []}})
    resumed.close()
    assert [(r["step"], r["group"]) for r in read_samples(run_dir)] == [(0, "g0"), (1, "g1"), (1, "g1"), (1, "g7"),
                                                                         (2, "g7")]


def test_overwrite_deletes_the_samples_record(tmp_path):
    from openrlhf_async.trainer import checkpoint

    cfg = Config(runs_dir=str(tmp_path), overwrite=True)
    os.makedirs(cfg.run_dir)
    with open(os.path.join(cfg.run_dir, "samples.jsonl"), "w") as f:
        f.write('{"step": 1}\n')
    assert checkpoint.earlier_records(cfg) == ["samples.jsonl"]
    checkpoint.remove_records(cfg)
    assert not os.listdir(cfg.run_dir)


def test_samples_are_a_wandb_table_offline(tmp_path, tokenizer, prompts, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    run_dir = str(tmp_path / "run")
    log = MetricsLog(run_dir, 2, progress=False, logger=backends(wandb_mode="offline"),
                     samples=SampleText(tokenizer, prompts), wandb_close_timeout_s=60)
    for metrics in steps(tokenizer, prompts):
        log.log(metrics)
    log.close()
    tables = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "files", "media", "table", "*", "*.json"))
    data = {}
    for path in tables:
        with open(path) as f:
            data.setdefault(os.path.basename(os.path.dirname(path)), []).extend(json.load(f)["data"])
    assert sorted(data) == ["eval", "train"], tables
    assert sorted(r[0] for r in data["train"]) == [1, 1, 1, 2, 2] and sorted(r[0] for r in data["eval"]) == [0, 2]
    assert "[observation 1] =6" in {r[1]: r[3] for r in data["train"]}["g7"]


class _ListQueue:
    def __init__(self, items=()):
        self.items = list(items)

    def qsize(self):
        return len(self.items)

    def get(self, timeout):
        return self.items.pop(0)

    def put(self, item):
        self.items.append(item)


def test_the_trainer_sends_the_first_groups_and_evaluation_answers(monkeypatch):
    """TrainingActor in-process (no engines, a stand-in step, evaluation faked): each step's record carries the
    episodes of its first --logger.log_samples groups, and each evaluation's first answers once."""
    from openrlhf_async.trainer import evaluate, pipeline

    monkeypatch.setattr(pipeline, "_live_version", lambda engines: 0)
    evaluations = []

    def fake_evaluate(cfg, engines, eval_prompts):
        evaluations.append(len(evaluations))
        groups = [[Episode(f"e{len(evaluations)}-{p}-{i}", [p]) for i in range(2)] for p in range(3)]
        return {"eval/accuracy": 0.5}, groups

    monkeypatch.setattr(evaluate, "evaluate", fake_evaluate)
    cfg = Config()
    cfg.mode, cfg.train.max_steps, cfg.eval.steps, cfg.ckpt.save_steps = "sync", 3, 2, -1
    cfg.logger.log_samples = 2

    def episode(request_id):
        return Episode(request_id, [1], response_ids=[2], action_mask=[1], token_versions=[0], reward=1.0)

    batches = [pipeline.QueuedBatch(i, i, [[episode(f"b{i}-{g}-{s}") for s in range(2)] for g in range(3)],
                                    {"rollout/time_to_batch_s": 0.1, "rollout/tokens_generated": 1,
                                     "rollout/stale_groups_dropped": 0}, [(i, i)], [], []) for i in range(3)]
    logged = _ListQueue()
    trainer = pipeline.TrainingActor(cfg, NO_POLICY, StandInSync(), _ListQueue(batches), logged,
                                     [{"prompt_ids": [0], "label": "0"}], num_prompts=3, stand_in_train_s=0.0)
    trainer.run()
    sent = [(m["step"], [ep.request_id for ep in m["_samples"]["train"]],
             [ep.request_id for ep in m["_samples"]["eval"]]) for m in logged.items]
    assert sent == [(0, [], ["e1-0-0", "e1-1-0"]),
                    (1, ["b0-0-0", "b0-0-1", "b0-1-0", "b0-1-1"], []),
                    (2, ["b1-0-0", "b1-0-1", "b1-1-0", "b1-1-1"], ["e2-0-0", "e2-1-0"]),
                    (3, ["b2-0-0", "b2-0-1", "b2-1-0", "b2-1-1"], ["e3-0-0", "e3-1-0"])]

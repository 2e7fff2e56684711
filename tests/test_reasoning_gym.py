"""reasoning-gym's generators as a prompt source (--data.reasoning_gym) and their scorers as the reward
(reward/reasoning_gym_reward.py), made locally from a seed."""

import json

import pytest

from openrlhf_async.data.reasoning_gym_tasks import task_names, write_tasks
from openrlhf_async.reward.reasoning_gym_reward import extract_answer, reward_func


def test_tasks_are_written_with_held_out_questions_none_of_which_is_trained_on(tmp_path):
    train_path, eval_path = write_tasks("chain_sum,basic_arithmetic", 50, 3, str(tmp_path),
                                        '{"chain_sum": {"min_terms": 2, "max_terms": 2}}')
    train = [json.loads(line) for line in open(train_path)]
    held_out = [json.loads(line) for line in open(eval_path)]
    assert len(train) == 100 and 150 < len(held_out) <= 200  # 100 per task from another seed, less repeats
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    sources = [json.loads(r["label"])["metadata"]["source_dataset"] for r in train]
    assert sources.count("chain_sum") == sources.count("basic_arithmetic") == 50
    chain = [json.loads(r["label"]) for r in train if "chain_sum" in r["label"]]
    assert all(entry["metadata"]["num_terms"] == 2 for entry in chain)  # the generator's settings were applied
    assert all(r["prompt"].endswith("Put your final answer within \\boxed{}.") for r in train)
    # The same seed makes the same questions.
    again, _ = write_tasks("chain_sum,basic_arithmetic", 50, 3, str(tmp_path / "again"),
                           '{"chain_sum": {"min_terms": 2, "max_terms": 2}}')
    assert open(again).read() == open(train_path).read()


@pytest.mark.parametrize("spec, args, message", [
    ("chain_summ", "{}", "--data.reasoning_gym 'chain_summ': unknown task(s) chain_summ; reasoning-gym has ab, acre"),
    ("chain_sum", "{\"gcd\": {}}", "--data.reasoning_gym_args names gcd, not among --data.reasoning_gym's tasks"),
    ("chain_sum", "{\"chain_sum\": {\"no_such\": 1}}", "--data.reasoning_gym_args for chain_sum: reasoning-gym "
                                                         "refused them"),
    ("chain_sum", "{chain", "--data.reasoning_gym_args is not JSON"),
])
def test_bad_task_names_and_settings_are_refused_in_one_line(tmp_path, spec, args, message):
    with pytest.raises(ValueError) as error:
        write_tasks(spec, 5, 0, str(tmp_path), args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_tasks_own_scorer_judges_the_last_boxed_answer():
    (name,) = task_names("basic_arithmetic")
    import reasoning_gym

    entry = reasoning_gym.create_dataset(name, size=1, seed=7)[0]
    label, prompt = json.dumps(entry), entry["question"]
    answers = [f"Let me see: \\boxed{{{int(entry['answer']) + 1}}}, no, \\boxed{{{entry['answer']}}}",
               f"<answer>{entry['answer']}</answer>", f"I think\n{entry['answer']}", "\\boxed{1e9}"]
    out = reward_func([prompt + a for a in answers], [prompt] * 4, [label] * 4)
    assert out["rewards"] == [1.0, 1.0, 1.0, 0.0] and out["extra_logs"]["accuracy"] == [1.0, 1.0, 1.0, 0.0]
    assert extract_answer("\\boxed{\\frac{1}{2}} and more") == "\\frac{1}{2}"
    # An unboxed last line that works the sum out answers with what follows its last "=".
    assert [extract_answer(t) for t in ("So:\n5 + 3 = 8.<|im_end|>", "**x = -2**</s>", "The answer is 8")] == [
        "8", "-2", "The answer is 8"]


def test_a_dry_run_with_reasoning_gym_tasks_passes_and_an_unknown_task_fails(tmp_path):
    from test_bad_input import run_cli

    assert run_cli(tmp_path, "--data.reasoning_gym", "chain_sum", "--data.reasoning_gym_size", "30", "--dry_run") == 0
    assert run_cli(tmp_path, "--data.reasoning_gym", "no_task", "--dry_run") != 0


# Tasks whose entries carry no answer (None: many are right) and no example of one: their scorers play the model's
# moves, and there is no correct plan at hand to play.
NO_GOLD = {"boxnet": "answer None, and no example plan in its metadata (its scorer carries the boxes out)",
           "rush_hour": "answer None, and no example solution in its metadata (only min_moves)"}
# Tasks whose answer is None but whose metadata holds one right answer among many.
EXAMPLE = {"graph_color": lambda m: json.dumps(m["possible_answer"]),
           "propositional_logic": lambda m: m["example_answer"],
           "rubiks_cube": lambda m: m["example_correct_answer"]}


def test_every_tasks_gold_answer_scores_1_through_the_reward_a_run_uses():
    import asyncio

    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    from openrlhf_async.data import reasoning_gym_tasks
    from openrlhf_async.data.reasoning_gym_tasks import INSTRUCTION, rows
    from openrlhf_async.reward import reasoning_gym_reward
    from openrlhf_async.reward.sources import load_reward_func

    names = sorted(set(DATASETS) - {"composite"} - set(NO_GOLD))
    made = rows(names, 3, 0)  # what the child process of a start writes, a question's entry as its JSON label
    # composite mixes other tasks (--data.reasoning_gym's comma does too): its entries go to their own task's scorer.
    mixed = reasoning_gym.create_dataset("composite", size=4, seed=0, datasets=[
        DatasetSpec("arc_agi", 1, {}), DatasetSpec("rearc", 1, {}), DatasetSpec("chain_sum", 1, {})])
    made += [{"prompt": f"{e['question']}\n{INSTRUCTION}", "label": reasoning_gym_tasks.entry_label(e)} for e in mixed]
    queries, prompts, labels, sources = [], [], [], []
    for row in made:
        entry = reasoning_gym_tasks.entry_of(row["label"])
        source = entry["metadata"]["source_dataset"]
        gold = EXAMPLE[source](entry["metadata"]) if source in EXAMPLE else entry["answer"]
        assert row["prompt"].endswith(INSTRUCTION) and isinstance(gold, str), (source, gold)
        # As the prompt asks: the answer, multi-line ones (ARC's grids) too, in \boxed{}, then the end of turn.
        queries.append(f"{row['prompt']}Let me work it out.\n\\boxed{{{gold}}}<|im_end|>")
        prompts.append(row["prompt"])
        labels.append(row["label"])
        sources.append(source)
    reward = load_reward_func(reasoning_gym_reward.__file__)  # as --data.reasoning_gym's run loads it
    results = asyncio.run(reward.score(queries, prompts, labels))
    asyncio.run(reward.close())
    below = {f"{source} (row {i})": r["reward"] for i, (source, r) in enumerate(zip(sources, results))
             if r["reward"] != 1}
    assert not below, below
    assert all(reasoning_gym_tasks.entry_of(reasoning_gym_tasks.entry_label(e)) == e for e in mixed)  # tuples kept
    assert set(sources) == set(names) and len(results) == 3 * len(names) + 4
    for name in NO_GOLD:  # still no answer to give: else it belongs above
        assert reasoning_gym.create_dataset(name, size=1, seed=0)[0]["answer"] is None, name

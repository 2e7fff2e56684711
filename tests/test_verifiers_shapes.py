"""verifiers environments as their authors write them (issue 48): seats with names of their own (a two-player zero-sum
game, each seat trained on its own payoff; one seat's two attempts, each on its own score), tasks without a prompt
(the environment opens each conversation), an endless task list (read as far as --agent.verifiers_max_tasks), a
checker that runs the model's answer as code (in this project's sandbox: a hostile answer is contained), a tool
environment (refused at the dry run in one line) and an episode that fails (verifiers' own error). The environments
are written here; the model is a scripted OpenAI endpoint (scripted_model) but in the end-to-end run, which trains on
the embedded tiny model."""

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import user_file
from test_hostile_inputs import dry_run, one_error_line
from test_reward_model import _trained_steps

# Each seat is asked its own question by the env (the task has no prompt); a program in the seat's runtime checks its
# answer (a Python expression); the game is zero-sum.
DUEL = """
import itertools

import verifiers.v1 as vf

__all__ = ["DuelTaskset", "DuelEnv"]

CHECK = "print(eval(open('answer.py').read()))"


class DuelData(vf.TaskData):
    questions: list
    answers: list


class DuelTask(vf.Task[DuelData, vf.State, vf.TaskConfig]):
    @vf.metric
    async def right(self, trace: vf.Trace, runtime) -> float:
        await runtime.write("answer.py", trace.last_reply.encode())
        await runtime.write("check.py", CHECK.encode())
        result = await runtime.run(["python3", "check.py"], {})
        return float(result.exit_code == 0 and result.stdout.strip() == self.data.answers[int(trace.agent.name[-1])])


class DuelTaskset(vf.Taskset[DuelTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            a = 10 + i % 80
            yield DuelTask(DuelData(questions=[f"{a}+3=", f"{a}+4="], answers=[str(a + 3), str(a + 4)]),
                           self.config.task)


class DuelConfig(vf.EnvConfig):
    player0: vf.AgentConfig = vf.AgentConfig()
    player1: vf.AgentConfig = vf.AgentConfig()


class DuelEnv(vf.Env[DuelConfig]):
    async def run(self, task, agents):
        for seat, question in zip((agents.player0, agents.player1), task.data.questions):
            async with seat.interaction(task) as chat:
                await chat.turn(question)

    async def finalize(self, task, episode):
        # A seat that could not answer (its request refused: the token budget spent) forfeits; else right beats wrong.
        p0, p1 = (episode.by_agent[name][0] for name in ("player0", "player1"))
        outcome = p0.metrics["right"] - p1.metrics["right"] if p0.ok and p1.ok else float(p0.ok) - float(p1.ok)
        p0.record_reward("outcome", outcome)
        p1.record_reward("outcome", -outcome)
"""

# One seat, two attempts: the second when the first failed. The checker runs the answer as a program.
GOLF = """
import verifiers.v1 as vf

__all__ = ["GolfTaskset", "GolfEnv"]


class GolfData(vf.TaskData):
    expected: str


class GolfTask(vf.Task[GolfData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def passes(self, trace: vf.Trace, runtime) -> float:
        await runtime.write("solution.py", trace.last_reply.encode())
        result = await runtime.run(["python3", "solution.py"], {})
        trace.record_metric("leaked", float("SECRET" in result.stdout))
        trace.record_metric("reached_network", float("NET" in result.stdout))
        return float(result.exit_code == 0 and result.stdout.strip() == self.data.expected)


class GolfTaskset(vf.Taskset[GolfTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10, 14):
            yield GolfTask(GolfData(prompt=f"Print {a}+3.", expected=str(a + 3)), self.config.task)


class GolfConfig(vf.EnvConfig):
    golfer: vf.AgentConfig = vf.AgentConfig()


class GolfEnv(vf.Env[GolfConfig]):
    async def run(self, task, agents):
        if (await agents.golfer.run(task)).reward < 1:
            await agents.golfer.run(task.with_data(prompt=task.data.prompt + " Again."))
"""

TOOLS = """
import verifiers.v1 as vf

__all__ = ["CalcTaskset"]


class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        \"\"\"a + b\"\"\"
        return a + b


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        yield CalcTask(CalcData(prompt="10+3=", answer="13"), self.config.task)
"""

BROKEN_RUN = GOLF.replace("    async def run(self, task, agents):\n",
                          "    async def run(self, task, agents):\n        raise ValueError('the board is broken')\n")

HOSTILE = """
import os, socket
for path in {outside!r}:
    try:
        open(path, "w").write("x")
    except OSError:
        pass
try:
    print(open({secret!r}).read())
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("NET")
except OSError:
    pass
print(13)
"""


@contextlib.asynccontextmanager
async def scripted_model(answer):
    """An OpenAI chat endpoint on loopback answering answer(the last user message) -> the reply's text, or an int: that
    HTTP status (a refused request). Yields (an episode's base URL on it, the requests it got)."""
    from aiohttp import web

    seen = []

    async def chat(request):
        body = await request.json()
        question = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        seen.append({"session": request.headers.get("X-Session-ID"), "question": question})
        reply = answer(question)
        if isinstance(reply, int):
            return web.json_response({"error": {"message": "refused", "code": reply}}, status=reply)
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": reply}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/episodes/k/v1", seen
    finally:
        await runner.cleanup()


def play(agent, label: str, answer):
    """One episode of the task `label` against scripted_model(answer): (the StepResult, the requests)."""
    async def episode():
        async with scripted_model(answer) as (url, seen):
            return await agent.run(None, "policy", "", label, episode="k", base_url=url), seen

    return asyncio.run(episode())


@pytest.mark.parametrize("replies, payoffs", [
    ({"10+3=": "13", "10+4=": "15"}, (1.0, -1.0)),  # player0 right, player1 wrong
    ({"10+3=": "12", "10+4=": "14"}, (-1.0, 1.0)),
    ({"10+3=": "13", "10+4=": "14"}, (0.0, 0.0)),
    ({"10+3=": "12", "10+4=": 400}, (1.0, -1.0)),  # player1's request refused (its budget spent): it forfeits
])
def test_each_seat_of_a_zero_sum_game_gets_its_own_payoff(tmp_path, replies, payoffs):
    from openrlhf_async.agent.verifiers_env import VerifiersAgent

    agent = VerifiersAgent(user_file(tmp_path, "vf_duel.py", DUEL), max_tasks=4)
    result, seen = play(agent, "0", replies.get)
    # Each seat's calls carried its trace's id; each trace trains on its own seat's payoff.
    assert sorted(result.sessions.values()) == sorted(zip(("player0", "player1"), payoffs))
    assert {r["session"]: r["question"][3] for r in seen} == {
        session: "3" if seat == "player0" else "4" for session, (seat, _) in result.sessions.items()}
    assert result.reward == payoffs[0]  # the episode's own: its first seat's, the game's outcome (no 0.0)
    assert (result.extra_info["reward_player0"], result.extra_info["reward_player1"]) == payoffs


def test_each_attempt_of_a_seat_is_scored_on_its_own(tmp_path):
    from openrlhf_async.agent.verifiers_env import VerifiersAgent

    agent = VerifiersAgent(user_file(tmp_path, "vf_golf.py", GOLF))
    result, seen = play(agent, "0", lambda q: "print(13)" if "Again" in q else "print(12)")
    first, second = (result.sessions[r["session"]] for r in seen)
    assert (first, second) == (("golfer", 0.0), ("golfer", 1.0)) and result.reward == 1.0


@pytest.mark.parametrize("mode", ["bwrap", "unsafe"])
def test_a_hostile_answer_run_by_a_checker_is_contained(tmp_path, mode):
    # The model's answer tries to write in the user's home and in /tmp, to read a secret file and to reach the
    # network. Sandboxed, all fails and the checker still runs it (it prints the expected 13). On verifiers' own
    # runtime (--agent.sandbox unsafe, accepting the risk) all succeeds: what the sandbox stops is real.
    from openrlhf_async.agent.verifiers_env import VerifiersAgent

    home, outside = tmp_path / "home", tmp_path / "outside"
    for folder in (home, outside):
        folder.mkdir()
        os.chmod(folder, 0o777)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    agent = VerifiersAgent(user_file(tmp_path, "vf_golf.py", GOLF), sandbox=mode)
    port = []
    hostile = lambda q: HOSTILE.format(outside=(str(home / "pwned"), str(outside / "pwned")), secret=str(secret),
                                       port=port[0])

    async def episode():
        async with scripted_model(hostile) as (url, _):
            port.append(int(url.split(":")[2].split("/")[0]))
            return await agent.run(None, "policy", "", "0", episode="k", base_url=url)

    result = asyncio.run(episode())
    tried = (os.listdir(home) + os.listdir(outside), result.extra_info["leaked"], result.extra_info["reached_network"])
    if mode == "bwrap":
        assert tried == ([], 0.0, 0.0) and result.reward == 1.0
    else:
        assert tried == (["pwned", "pwned"], 1.0, 1.0)


def test_a_link_out_of_the_runtimes_folder_is_refused_not_followed(tmp_path):
    from verifiers.v1.errors import SandboxError
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime

    from openrlhf_async.agent.verifiers_runtime import SandboxedRuntime, install

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    install("bwrap", 30.0)

    async def attempt():
        runtime = make_runtime(SubprocessConfig())
        assert isinstance(runtime, SandboxedRuntime) and not runtime.supports_live_processes
        await runtime.start()
        try:
            made = await runtime.run(["python3", "-c", f"import os; os.symlink({str(secret)!r}, 'out.txt')"], {})
            assert made.exit_code == 0
            for io in (runtime.read("out.txt"), runtime.write("out.txt", b"overwritten")):
                with pytest.raises(SandboxError, match="resolves outside the runtime's working folder"):
                    await io
        finally:
            await runtime.stop()

    asyncio.run(attempt())
    assert secret.read_text() == "SECRET"


def test_named_seats_get_the_runtime_and_harness_and_a_wrong_seat_is_named_in_one_line(tmp_path):
    from openrlhf_async.agent import AgentFileError
    from openrlhf_async.agent.verifiers_env import HARNESS_ID, load_env, prompt_rows

    path = user_file(tmp_path, "vf_duel.py", DUEL)
    env = load_env(path)
    for seat in (env.config.player0, env.config.player1):
        assert seat.runtime.type == "subprocess" and seat.harness.id == HARNESS_ID
    # Tasks without a prompt (the environment opens the conversation) are prompt rows all the same.
    assert prompt_rows(env, 3) == [{"prompt": f"task {i} (the environment opens the conversation)", "label": str(i)}
                                   for i in range(3)]
    with pytest.raises(AgentFileError) as e:
        load_env(path, '{"agent": {"max_turns": 2}}')
    assert str(e.value).endswith("(ValidationError: agent: Extra inputs are not permitted; its seats: player0, "
                                 "player1; --agent.verifiers_args addresses them by name)") and "\n" not in str(e.value)
    with pytest.raises(AgentFileError, match="seat 'player1' asks for the docker runtime, .* --agent.sandbox unsafe"):
        load_env(path, '{"player1": {"runtime": {"type": "docker"}}}')


def test_a_tool_environment_is_refused_at_the_dry_run_in_one_line(tmp_path, capsys):
    path = user_file(tmp_path, "vf_tools.py", TOOLS)
    assert dry_run(tmp_path, "--agent.verifiers_env", path) == 2
    assert one_error_line(capsys) == (
        f"error: --agent.verifiers_env {path}: its tasks use MCP tools (1 tool server(s)), which the harness of seat "
        "'agent' (openrlhf_async_verifiers_harness) does not serve (this project's in-process chat harness has no "
        "tools); give the seat a harness of the environment's own that supports MCP (--agent.verifiers_args) or use "
        "tasks without tools")


def test_a_failed_episode_reports_verifiers_own_error(tmp_path):
    from openrlhf_async.agent.verifiers_env import VerifiersAgent

    agent = VerifiersAgent(user_file(tmp_path, "vf_broken_run.py", BROKEN_RUN))
    with pytest.raises(RuntimeError, match=r"^the verifiers episode failed: EnvError: GolfEnv\.run\(\): ValueError: "
                                           r"the board is broken$"):
        play(agent, "0", lambda q: "print(13)")
    with pytest.raises(ValueError, match="label '9' names no task of --agent.verifiers_env"):
        play(agent, "9", lambda q: "print(13)")
    # A request lost on the way to the model (a 5xx, a dropped connection) is no forfeit of the seat's.
    duel = VerifiersAgent(user_file(tmp_path, "vf_duel.py", DUEL), max_tasks=1)
    with pytest.raises(RuntimeError, match="^the verifiers episode failed: ProviderError: upstream 503"):
        play(duel, "0", {"10+3=": "13", "10+4=": 503}.get)


def test_each_seat_is_compared_with_its_own_seat_in_the_group():
    from openrlhf_async.rollout.episode import Episode
    from openrlhf_async.trainer.seats import part_advantages

    def game(p0: float) -> Episode:  # player0's part first (a segment), player1's the episode's own
        segment = {"prompt_ids": [1], "response_ids": [2], "logprobs": [0.0], "action_mask": [1],
                   "token_versions": [0], "seat": "player0", "seat_reward": p0}
        return Episode("g-0", [1], [3], [0.0], [1], [0], raw_reward=p0, reward=p0, segments=[segment],
                       seat="player1", seat_reward=-p0)

    group = [game(1.0), game(1.0), game(-1.0), game(1.0)]
    adv = part_advantages([group], torch.tensor([[ep.reward for ep in group]]), "group_norm")
    # player0: +1 +1 -1 +1 (mean 0.5, std 1), player1 the mirror: the winner's and the loser's advantages have
    # opposite signs in every episode, each against its own seat's mean.
    assert [[round(a, 4) for a in parts] for parts in adv[0]] == [[0.5, -0.5], [0.5, -0.5], [-1.5, 1.5], [0.5, -0.5]]


def test_padded_groups_give_each_group_the_advantages_it_has_alone():
    from openrlhf_async.trainer.losses import group_advantages

    dense = torch.tensor([[1.0, 0.0, 0.5], [2.0, 1.0, 0.0]])
    for estimator in ("group_norm", "rloo", "dr_grpo", "reinforce", "reinforce_baseline", "flash_reinforce"):
        present = torch.ones_like(dense, dtype=torch.bool)
        assert torch.allclose(group_advantages(dense, estimator, present=present), group_advantages(dense, estimator))
    padded, present = torch.tensor([[1.0, 0.0, 0.0], [2.0, 1.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    rows = group_advantages(padded, "group_norm", present=present)
    assert torch.allclose(rows[0, :2], group_advantages(torch.tensor([[1.0, 0.0]]))[0]) and rows[0, 2] == 0


def test_calls_of_each_session_are_sequences_of_their_own_with_its_reward():
    from openrlhf_async.rollout.endpoint import Call, episode_from_calls

    calls = [Call([1, 2], [3], [-0.1], [0], "stop", "p0"), Call([7, 8], [6], [-0.2], [0], "stop", "p1"),
             Call([1, 2, 3, 9], [5], [-0.3], [0], "stop", "p0"),  # continues p0's conversation, after p1's call
             Call([4], [4], [-0.4], [0], "stop", "discarded")]  # a trace verifiers retried: not trained
    ep = episode_from_calls("r", calls, {"p0": ("player0", 1.0), "p1": ("player1", -1.0)})
    assert ep.segments == [{"prompt_ids": [1, 2], "response_ids": [3, 9, 5], "logprobs": [-0.1, 0.0, -0.3],
                            "action_mask": [1, 0, 1], "token_versions": [0, 0, 0], "seat": "player0",
                            "seat_reward": 1.0}]
    assert (ep.prompt_ids, ep.response_ids, ep.seat, ep.seat_reward) == ([7, 8], [6], "player1", -1.0)


def test_every_segments_row_in_the_samples_carries_its_episodes_label():
    from transformers import PreTrainedTokenizerFast

    from openrlhf_async.rollout.episode import Episode
    from openrlhf_async.utils.samples import SampleText, prompt_key
    from tokenizers import Tokenizer, models

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({str(i): i for i in range(20)},
                                                                                    unk_token="0")))
    dataset_prompt = [5, 6, 7]
    segment = {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [0.0], "action_mask": [1],
               "token_versions": [0]}
    # An OpenAI-API agent's episode: its calls' prompts (a template that rewrites history) are not the dataset's.
    ep = Episode("g1-0", [8, 9], [4], [0.0], [1], [0], reward=1.0, segments=[segment],
                 prompt_key=prompt_key(dataset_prompt))
    rows = SampleText(tokenizer, [{"prompt_ids": dataset_prompt, "label": "L"}]).rows(1, {"train": [ep]})
    assert [(r["prompt"], r["label"]) for r in rows] == [("1 2", "L"), ("8 9", "L")]


# A minute through the CLI, so with the long tests (make test-long): in the default suite the seats' runtime, harness
# and payoffs are checked above and below in process, and test_verifiers_env trains an environment through the CLI.
@pytest.mark.long
def test_a_game_with_named_seats_trains_each_seat_on_its_own_payoff(tmp_path):
    # Through the CLI on the embedded tiny model: an endless task list read as far as --agent.verifiers_max_tasks,
    # tasks the environment opens itself, named seats, a checker running each answer in the sandbox.
    from openrlhf_async.config import preset_path

    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_async.cli.train_async", "@" + preset_path("tiny_cpu"),
         "--agent.verifiers_env", user_file(tmp_path, "vf_duel.py", DUEL), "--agent.verifiers_max_tasks", "8",
         "--runs_dir", str(tmp_path / "runs"), "--run_name", "vf", "--no-progress", "--train.max_steps", "2",
         "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
         "--rollout.max_new_tokens", "32", "--logger.log_samples", "4", "--rollout.unbiased_early_stop"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    trained = _trained_steps(tmp_path / "runs" / "vf")
    assert [m["engine_weight_version"] for m in trained] == [1, 2]
    for m in trained:
        assert m["rollout/agent_errors"] == 0 and m["grad_norm"] > 0
        assert m["rollout/extra/reward_player0"] == -m["rollout/extra/reward_player1"]  # zero-sum
    rows = [json.loads(line) for line in (tmp_path / "runs" / "vf" / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    assert rows and all(r["label"] in [str(i) for i in range(8)] and r["error"] is None for r in rows)
    episodes = {}
    for r in rows:
        episodes.setdefault(r["episode"], {})[r["seat"]] = r
    checked = 0
    for seats in episodes.values():
        if "player1" not in seats:  # player0's reply spent the episode's tokens: player1 forfeits
            assert seats["player0"]["reward"] == 1.0
            continue
        right = []
        for seat in ("player0", "player1"):
            a, b = re.search(r"(\d+)\+(\d)=", seats[seat]["prompt"]).groups()
            reply = "".join(t["response"] for t in seats[seat]["turns"]).replace("<|endoftext|>", "").strip()
            right.append(reply == str(int(a) + int(b)) if re.fullmatch(r"[1-9][0-9]*", reply) else None)
        assert seats["player0"]["reward"] == -seats["player1"]["reward"]
        if None not in right:  # plain numbers: the checker's verdict is known here
            assert seats["player0"]["reward"] == float(right[0]) - float(right[1])
            checked += 1
    assert checked >= len(episodes) // 2, episodes

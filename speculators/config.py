"""Training recipes: a YAML file of plain values plus `--key=value` overrides, checked strictly."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe that cannot run; the message names the bad key or value."""


@dataclass(frozen=True)
class Range:
    """The values a numeric recipe key allows: lo..hi, either end open or unbounded (None)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, lo_open=True)
FRACTION = Range(0, 1)

# Every numeric key of a stage and of a recipe, with the values it allows. A value outside them
# would not fail, only do something else than asked (0 steps writes an untrained speculator), so
# it is refused before anything loads.
STAGE_RANGES = {
    "steps": AT_LEAST_1,
    "lr_scale": POSITIVE,
    "num_prompts": AT_LEAST_1,
    "prompt_tokens": AT_LEAST_1,
    "gen_tokens": AT_LEAST_1,
    "gen_temperature": AT_LEAST_0,  # 0: greedy
    "gen_top_k": AT_LEAST_0,  # 0: the whole distribution
    "onpolicy_fraction": FRACTION,
}
CONFIG_RANGES = {
    "max_samples": AT_LEAST_0,  # 0: every row of the data set
    "seq_len": Range(16),  # data.build_dataset drops rows shorter than 16 tokens
    "n_predict": AT_LEAST_1,
    "inner_dim": AT_LEAST_0,  # 0: the target's hidden size
    "init_samples": AT_LEAST_1,
    "init_token_bias": AT_LEAST_0,
    "medusa_layers": AT_LEAST_0,
    "draft_vocab": AT_LEAST_0,
    "beta": FRACTION,
    "temperature": POSITIVE,
    "head_weight_decay": POSITIVE,
    "lr": POSITIVE,
    "weight_decay": AT_LEAST_0,
    "warmup_steps": AT_LEAST_0,
    "batch_size": AT_LEAST_1,
    "micro_batch_size": AT_LEAST_1,
    "grad_clip": AT_LEAST_0,  # 0: no clipping
    "seed": Range(0, 2**32 - 1),  # numpy's seeds, which accelerate's set_seed sets too
    "save_every": AT_LEAST_1,
    "log_every": AT_LEAST_1,
    "vllm_kv_cache_gib": POSITIVE,
}


def check_ranges(obj, ranges: dict, where: str = "") -> None:
    for key, allowed in ranges.items():
        value = getattr(obj, key)
        if value not in allowed:
            raise ConfigError(f"{where}{key}={value!r} is out of range; allowed: {allowed}")


@dataclass
class Stage:
    """One training stage. data: 'dataset' (the recipe's data set), 'target' (continuations the
    target generates from the data set's prompts: IBM stage 2 / Medusa self-distillation / SeqKD) or,
    for draft models, 'draft' (on-policy: every step the draft samples continuations of the stage's
    prompts and the target scores them). onpolicy_fraction (GKD's lambda) makes a 'dataset' or
    'target' stage take an on-policy batch instead with that probability, drawn per step."""

    name: str = "stage1"
    data: str = "dataset"
    steps: int = 100
    lr_scale: float = 1.0
    num_prompts: int = 256  # data: target — prompts to continue
    prompts: str = "chat"  # data: target — "chat": first user turns, chat-templated (the target answers);
    #                        "prefix": the first prompt_tokens tokens of data-set rows (IBM stage 2)
    prompt_tokens: int = 64  # data: target — prefix length, or the longest chat prompt kept
    gen_tokens: int = 128  # data: target — tokens generated per prompt
    gen_temperature: float = 1.0  # 0 = greedy (Medusa self-distillation)
    gen_top_k: int = 10  # 0 = the whole distribution (on-policy DistillSpec samples the draft at T=1, no top-k)
    onpolicy_fraction: float = 0.0
    # who generates a generating stage's continuations: "builtin" (transformers' generate), "vllm", or
    # "auto" (vLLM where it is installed and a GPU is present, else built-in); speculators/generation.py
    generator: str = "auto"


@dataclass
class TrainConfig:
    kind: str = "mlp_speculator"  # mlp_speculator | medusa | draft_model
    target: str = "smollm2-135m-instruct"
    # auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32. An AVX2-only CPU
    # emulates bf16 GEMMs: the target's forward ran 6x slower in bf16 than in fp32 on such a machine.
    target_dtype: str = "auto"  # auto | bf16 | fp32
    data: str = "sharegpt"
    max_samples: int = 4000
    seq_len: int = 512
    # proposer shape
    n_predict: int = 3
    inner_dim: int = 0
    tie_weights: bool = False
    scale_input: bool = True
    # How the speculator starts: "random"; "target" (embeddings and lm heads copied from the target's);
    # "regression" (MLP speculator only: every stage starts as the least-squares linear predictor of the
    # target's next hidden state, read out through the target's frozen lm head; see lstsq_init.regression_init).
    init: str = "target"
    init_samples: int = 1000  # init: regression — training rows the least-squares fit reads
    # init: regression — 0: each token's vector is linear in the target's embedding; λ > 0: every token
    # also gets its own offset, ridge-shrunk by λ occurrences (see lstsq_init.regression_init)
    init_token_bias: float = 0.0
    medusa_layers: int = 1
    medusa_shared_lm_head: bool = False  # True: the target's frozen lm head (vLLM original_lm_head)
    # MLP speculator and Medusa. 0: heads over the whole vocabulary. N: a draft vocabulary (FR-Spec) of the N
    # tokens most frequent in the training data's loss tokens; every other head row stays zero, so the
    # export loads in vLLM unchanged, while the loss and the built-in engine's proposal read N/V of the
    # head: the vocabulary GEMMs are most of the cost on a CPU.
    draft_vocab: int = 0
    # draft model (kind: draft_model, DistillSpec): where the draft starts
    draft_init: str = "layers"  # layers | model | config
    draft_layers: list = field(default_factory=list)  # layers: indices of the target's decoder layers kept
    draft_model: str = ""  # model: alias, directory or .gguf file of a smaller model with the target's tokenizer
    draft_config: dict = field(default_factory=dict)  # config: overrides of the target's config (num_hidden_layers: 2)
    gradient_checkpointing: bool = False  # recompute the draft's layer activations in backward
    # loss
    divergence: str = "fkl"  # ce | fkl | rkl | jsd | tvd  (ce uses the tokens; the others the target's distribution)
    beta: float = 0.5
    temperature: float = 1.0
    head_weight_decay: float = 1.0  # head i weighs decay**i (Medusa-2 uses 0.8)
    # How the loss gets the teacher: "hidden" recomputes the target's logits tile by tile from its
    # hidden states (memory stays flat: the GPU default); "logits" takes the logits the target computes
    # once per position, shared by all heads (4 of 4+H vocab GEMMs saved: the CPU default, where
    # memory is plentiful and GEMMs are the bottleneck); "auto" picks by device.
    teacher: str = "auto"
    # true: run the target once over every data-set row at the start (fixed micro-batches, so resume and
    # DDP stay exact) and train dataset stages from those hidden states, without a target forward per
    # step. Holds rows x tokens x hidden size values in memory (600 x 256 x 576 in fp32: 0.35 GB), so it
    # suits recipes that revisit a small data set; the least-squares start reads the same cache.
    cache_hidden: bool = False
    # FSDP for a target too big for one device: every process loads and keeps 1/N of each of the frozen
    # target's decoder layers and all-gathers one layer at a time in its forward (torch's fully_shard;
    # gloo on a CPU, NCCL on GPUs). The speculator, small, stays replicated under DDP. Needs --multi_gpu
    # with several processes and a safetensors target; a stage the target generates for must use
    # generator: vllm.
    shard_target: bool = False
    # optimisation
    stages: list = field(default_factory=lambda: [{"name": "stage1", "data": "dataset", "steps": 100}])
    # adamw: torch's, 8 bytes of state per parameter; adamw8bit: the same update on 8-bit moments,
    # 2 bytes (speculators/optim.py), for a draft of 0.5B+ parameters where the state dominates memory.
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    batch_size: int = 16  # sequences per optimizer step, over all processes
    micro_batch_size: int = 4  # sequences per forward on each process
    grad_clip: float = 1.0
    mixed_precision: str = "auto"  # auto | bf16 | fp32 (autocast for the speculator; master weights stay fp32; auto as target_dtype)
    seed: int = 0
    # checkpoints and logs
    output_dir: str = "runs/default"
    save_every: int = 50
    report_to: str = "none"  # none | wandb | tensorboard
    log_every: int = 10
    vllm_kv_cache_gib: float = 2.0  # KV-cache memory of a vLLM generator (generator: vllm / auto on a GPU)

    def __post_init__(self):
        self.stages = [s if isinstance(s, Stage) else _strict(Stage, s, "stages[]") for s in self.stages]
        if not self.stages:
            raise ConfigError("stages=[]: give at least one stage, e.g. stages: [{steps: 100}]")
        check_ranges(self, CONFIG_RANGES)
        checks = {
            "kind": ("mlp_speculator", "medusa", "draft_model"),
            "draft_init": ("layers", "model", "config"),
            "divergence": ("ce", "fkl", "rkl", "jsd", "tvd"),
            "target_dtype": ("auto", "bf16", "fp32"),
            "mixed_precision": ("auto", "bf16", "fp32"),
            "report_to": ("none", "wandb", "tensorboard"),
            "teacher": ("auto", "hidden", "logits"),
            "init": ("random", "target", "regression"),
            "optimizer": ("adamw", "adamw8bit"),
        }
        for key, allowed in checks.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{key}={getattr(self, key)!r} is not one of {list(allowed)}")
        for s in self.stages:
            check_ranges(s, STAGE_RANGES, f"stage {s.name}: ")
            if s.data not in ("dataset", "target", "draft"):
                raise ConfigError(f"stage {s.name}: data={s.data!r} is not 'dataset', 'target' or 'draft'")
            if (s.data == "draft" or s.onpolicy_fraction) and self.kind != "draft_model":
                raise ConfigError(f"stage {s.name}: on-policy data needs kind: draft_model (only a draft model generates)")
            if s.generator not in ("auto", "builtin", "vllm"):
                raise ConfigError(f"stage {s.name}: generator={s.generator!r} is not 'auto', 'builtin' or 'vllm'")
            if s.prompts not in ("chat", "prefix"):
                raise ConfigError(f"stage {s.name}: prompts={s.prompts!r} is not 'chat' or 'prefix'")
        if self.init == "regression":
            if self.kind != "mlp_speculator" or self.scale_input:
                raise ConfigError("init: regression is for kind: mlp_speculator with scale_input: false")
        if self.init_token_bias and self.init != "regression":
            raise ConfigError(f"init_token_bias={self.init_token_bias}: give 0, or a shrinkage > 0 with init: regression")
        if self.draft_vocab and self.kind == "draft_model":
            raise ConfigError(f"draft_vocab={self.draft_vocab}: give 0 (the whole vocabulary) or, for an MLP "
                              f"speculator or Medusa, the number of tokens the heads may propose")
        if self.divergence == "jsd" and self.beta in (0, 1):
            raise ConfigError(f"beta={self.beta} makes the jsd loss exactly 0; give 0 < beta < 1")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(f"batch_size={self.batch_size} is not a multiple of "
                              f"micro_batch_size={self.micro_batch_size}")

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _strict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown config key(s) {unknown}; known keys: {sorted(known)}")
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    return cls(**{k: _typed(k, v, types[k], where) for k, v in data.items()})


def _typed(key: str, value, type_name: str, where: str):
    """A recipe value checked against its field's type. YAML 1.1 reads `1e-3` (no dot) as a string,
    so a float field takes any string float() accepts; anything else of the wrong type is refused
    here, in one line, rather than deep inside the run."""
    if type_name == "float":
        try:
            if not isinstance(value, bool):
                return float(value)
        except (TypeError, ValueError):
            pass
        raise ConfigError(f"{where}: {key}={value!r} is not a number")
    expected = {"int": int, "bool": bool, "str": str, "list": list, "dict": dict}.get(type_name)
    if expected and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: {key}={value!r} is not of type {type_name}")
    return value


def load_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """Recipe file, then `--key=value` / `--key value` overrides (values parsed as YAML)."""
    data = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text; a recipe is a YAML file") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = mark.line + 1 if mark else "?"
            raise ConfigError(f"{path}:{line}: not valid YAML ({_yaml_problem(err)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the recipe must be a YAML mapping")
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(overrides):
                raise ConfigError(f"--{key} needs a value")
            value, i = overrides[i + 1], i + 1
        try:
            data[key.replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"--{key}={value}: not a valid YAML value ({_yaml_problem(err)}); quote it as one "
                              f"argument, e.g. --stages='[{{steps: 100}}]'") from None
        i += 1
    return _strict(TrainConfig, data, path or "command line")


def _yaml_problem(err: yaml.YAMLError) -> str:
    return " ".join(filter(None, [getattr(err, "context", None), getattr(err, "problem", None)])) or str(err)

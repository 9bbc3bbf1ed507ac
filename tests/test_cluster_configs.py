"""Every YAML under ``recipes/configs/`` is read the way its recipe reads it, and every cluster config is checked
against the planner, so that no config can go stale silently: a change to a config, a recipe or the planner's cost
model that moves a config's predicted figures fails here, with the figures the planner gives now.

A config is one of two kinds, told apart by its header (comment lines, which the recipe's parser ignores):

* a **CPU config** (the recipes' defaults): ``trainer.accelerator: cpu`` and no ``# cluster:`` line;
* a **cluster config**: a ``# cluster:`` line, ``trainer.accelerator: gpu``, and the planner's view of it.

Any other config (a GPU accelerator without a ``# cluster:`` line, say) fails: none is skipped. The header::

    # recipe: recipes/<recipe>.py                              (every config)
    # model: <name>, <N> parameters                            (cluster configs; N as the planner counts them)
    # cluster: <nodes> x <GPUs per node> <GPU preset>          (cluster configs)
    # plan: lightning-hybrid plan ...                          (cluster configs; lines ending in \\ continue)
    # predicted: <layout>, #<rank> of <N> feasible layouts: <GiB> GiB per GPU (<GiB> usable), <N> tokens/s, MFU <x>%

What is checked, planner only (no training, no processes): the config parses through its recipe's
``LightningCLI`` (``--print_config``, in-process) with every value it sets; the ``# plan:`` command describes the
model, cluster, global batch and precision the config trains; the config's layout fits and is the fastest of the
plan's feasible layouts that leaves at least 5 % of the usable memory free (the headroom docs/tuning.md asks for);
the ``# predicted:`` figures agree with the planner's within 1 %.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest
import yaml

from lightning_hybrid.cli import main as lightning_hybrid_main
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.planner import search
from lightning_hybrid.planner.auto_layout import candidate_layouts
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.hardware import GIB, GPU_PRESETS, Cluster
from lightning_hybrid.planner.layout import Estimate, Layout
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.options.schedules import PLANNED_SCHEDULES
from recipes import finetune_hf, pretrain_gpt
from recipes.data import GrammarDataModule

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "recipes" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
RECIPES: dict[str, ModuleType] = {"recipes/pretrain_gpt.py": pretrain_gpt, "recipes/finetune_hf.py": finetune_hf}
#: How far a header's figures may be from the planner's (relative).
TOLERANCE = 0.01
#: The share of the usable memory a cluster config's layout leaves free: the planner's activations were 3-7 % low
#: without checkpointing and 10-15 % high with it (BENCHMARKS.md, "Planner: predicted vs measured").
HEADROOM = 0.05
#: HybridStrategy arguments that make up the planner's layout.
LAYOUT_ARGUMENTS = ("dp", "tp", "pp", "dp_replicate", "cp", "zero", "pp_schedule", "microbatches", "virtual_stages",
                    "activation_checkpointing", "shard_vocab")
#: Strategy arguments the cost model does not model, at the values its predictions assume.
UNMODELLED_DEFAULTS = {"offload": False, "reduce_dtype": None, "loss_parallel": False, "pp_split": None}
#: LlamaConfig fields that change no parameter's shape (the rest must be the dimensions the planner reads).
SHAPE_NEUTRAL_LLAMA_FIELDS = {"max_position_embeddings", "rope_theta", "rms_norm_eps", "bos_token_id",
                              "eos_token_id", "hidden_act", "attention_dropout", "initializer_range"}
#: Published parameter counts and how close the config's model must come: the Llama checkpoints'
#: model.safetensors.index.json total_size (bf16 bytes) / 2, exactly; GPT-3's 175.0B (Brown et al. 2020, Table 2.1,
#: rounded there), within 0.5 % (the recipe's GPT adds biases, 2048 learned positions and a vocabulary of 50304).
PUBLISHED_PARAMETERS = {"Meta-Llama-3-8B": (16_060_522_496 // 2, 0.0),
                        "Meta-Llama-3-70B": (141_107_412_992 // 2, 0.0), "GPT-3 175B": (175.0e9, 0.005)}
#: The planner refuses tied weights under pp, which the strategy trains (a known planner limitation, reported).
KNOWN_PLANNER_LIMITATIONS = ("tied (shared) weights cannot be split across pipeline stages",)
PREDICTED = re.compile(
    r"(?P<layout>[^,]+), #(?P<rank>\d+) of (?P<feasible>[\d,]+) feasible layouts: (?P<memory>[\d.]+) GiB per GPU"
    r" \((?P<usable>[\d.]+) usable\), (?P<tokens>[\d,]+) tokens/s, MFU (?P<mfu>[\d.]+)%$")


# ------------------------------------------------------------------------------------------------ the header
@dataclass(frozen=True)
class Predicted:
    """The ``# predicted:`` line."""

    text: str
    layout: str
    rank: int
    feasible: int
    memory_gib: float
    usable_gib: float
    tokens_per_second: float
    mfu: float


@dataclass(frozen=True)
class Header:
    """The machine-read comment lines of a config."""

    recipe: Optional[str]
    model: Optional[str]
    cluster: Optional[str]
    plan: Optional[list[str]]
    predicted: Optional[Predicted]

    @property
    def names_a_cluster(self) -> bool:
        return self.cluster is not None


def header_fields(text: str) -> dict[str, str]:
    """``{key: value}`` of the ``# key: value`` comment lines, a value ending in ``\\`` continued on the next."""
    fields: dict[str, str] = {}
    key: Optional[str] = None
    for line in text.splitlines():
        if not line.startswith("#"):
            key = None
            continue
        body = line[1:].strip()
        if key is not None:  # continuing the previous value
            fields[key] = fields[key][:-1].rstrip() + " " + body
        else:
            match = re.match(r"(recipe|model|cluster|plan|predicted): (.*)$", body)
            if match is None:
                continue
            key = match.group(1)
            fields[key] = match.group(2).strip()
        key = key if fields[key].endswith("\\") else None
    return fields


@functools.cache
def read_header(path: Path) -> Header:
    fields = header_fields(path.read_text())
    predicted = None
    if "predicted" in fields:
        match = PREDICTED.match(fields["predicted"])
        assert match is not None, f"{path.name}: '# predicted:' does not read as {PREDICTED.pattern}"
        predicted = Predicted(fields["predicted"], match["layout"], int(match["rank"]), number(match["feasible"]),
                              float(match["memory"]), float(match["usable"]), number(match["tokens"]),
                              float(match["mfu"]) / 100)
    plan = shlex.split(fields["plan"]) if "plan" in fields else None
    return Header(fields.get("recipe"), fields.get("model"), fields.get("cluster"), plan, predicted)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def cluster_configs() -> list[Path]:
    return [path for path in CONFIGS if read_header(path).names_a_cluster]


def cpu_configs() -> list[Path]:
    return [path for path in CONFIGS if not read_header(path).names_a_cluster]


# ------------------------------------------------------------------------------------ the config, as parsed
@functools.cache
def parsed_config(path: Path) -> dict[str, Any]:
    """The whole configuration the recipe builds from ``path`` (``fit --config PATH --print_config``, in-process;
    the recipe's default config first, then the file, as on the command line)."""
    header = read_header(path)
    assert header.recipe in RECIPES, f"{path.name}: '# recipe:' must be one of {', '.join(RECIPES)}"
    recipe = RECIPES[header.recipe]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exited:
        recipe.main(["fit", "--config", str(path), "--print_config"])
    assert exited.value.code in (0, None), f"{path.name} does not parse: {exited.value}"
    return yaml.safe_load(printed.getvalue())


@functools.cache
def model_shape(path: Path) -> ModelShape:
    """The model the config trains, as the planner sees it."""
    config = parsed_config(path)
    if read_header(path).recipe == "recipes/pretrain_gpt.py":
        return ModelShape.from_module("recipes.gpt:GPTLightning", {"config": gpt_config(config)},
                                      seq_len=config["model"]["config"]["block_size"],
                                      heads=config["model"]["config"]["n_head"])
    return llama_shape(config)


def gpt_config(config: dict[str, Any]) -> dict[str, int]:
    """``model.config`` with the vocabulary the recipe links into it at instantiation: the data's, padded."""
    data = config["data"]
    # The grammar's whole alphabet (39 characters) appears within its first few hundred sentences: a short corpus
    # has the vocabulary of the configured one, and the padding to vocab_multiple is the recipe's own.
    corpus = GrammarDataModule(num_chars=min(data["num_chars"], 100_000), seed=config["seed_everything"],
                               vocab_multiple=data["vocab_multiple"])
    return {**config["model"]["config"], "vocab_size": corpus.vocab_size}


def llama_shape(config: dict[str, Any]) -> ModelShape:
    """The Llama the fine-tuning recipe builds from ``tiny_llama`` (its stand-in checkpoint's config.json)."""
    fields = config["tiny_llama"]
    dimensions = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "tie_word_embeddings"}
    unknown = set(fields) - dimensions - SHAPE_NEUTRAL_LLAMA_FIELDS
    assert not unknown, f"tiny_llama fields the planner's shape does not read: {sorted(unknown)}"
    # FineTune builds the model with model.attn_implementation: "eager" materializes the attention scores, the
    # fused kernels ("sdpa", "flash_attention_2", ...) do not, which the planner calls flash attention.
    eager = config["model"]["attn_implementation"] == "eager"
    return ModelShape(layers=fields["num_hidden_layers"], hidden=fields["hidden_size"],
                      heads=fields["num_attention_heads"], kv_heads=fields["num_key_value_heads"],
                      ffn_hidden=fields["intermediate_size"], gated_mlp=True, vocab=fields["vocab_size"],
                      tied_embeddings=fields["tie_word_embeddings"], seq_len=fine_tuning_length(config),
                      flash_attention=not eager)


def fine_tuning_length(config: dict[str, Any]) -> int:
    """The tokens per sequence: ``data.pad_to``, or without it the longest generated pair (dynamic padding)."""
    data = config["data"]
    if data["pad_to"] is not None:
        return data["pad_to"]
    return max(len(inputs) for inputs, _ in finetune_hf.instruction_pairs(data["samples"], config["seed_everything"]))


def strategy_arguments(path: Path) -> dict[str, Any]:
    strategy = parsed_config(path)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hybrid.HybridStrategy", path.name
    return strategy["init_args"]


@dataclass(frozen=True)
class Training:
    """What the planner is asked about a config: its model, hardware, layout, global batch and precision."""

    model: ModelShape
    cluster: Cluster
    options: HybridOptions
    layout: Layout  # the planner's layout of ``options``, before the estimate fills in the schedule's defaults
    global_batch: int
    precision: str


def training(path: Path, cluster: Cluster) -> Training:
    config = parsed_config(path)
    arguments = strategy_arguments(path)
    options = HybridOptions(**{name: arguments[name] for name in LAYOUT_ARGUMENTS})
    trainer = config["trainer"]
    accumulation = trainer["accumulate_grad_batches"]
    (layout,) = candidate_layouts(options, cluster.gpus, accumulation)  # as the auto layout reads the options
    global_batch = config["data"]["batch_size"] * layout.dp * layout.dp_replicate * accumulation
    return Training(model_shape(path), cluster, options, layout, global_batch, trainer["precision"])


def named_cluster(path: Path) -> Cluster:
    """The ``# cluster:`` line's GPUs as the planner's preset, for the config's precision."""
    match = re.fullmatch(r"(\d+) x (\d+) (\S+)", read_header(path).cluster or "")
    assert match is not None, f"{path.name}: '# cluster:' is not '<nodes> x <GPUs per node> <preset>'"
    nodes, per_node, gpu = int(match[1]), int(match[2]), match[3]
    assert gpu in GPU_PRESETS, f"{path.name}: {gpu!r} is no GPU preset ({', '.join(GPU_PRESETS)})"
    precision = parsed_config(path)["trainer"]["precision"]
    return Cluster.preset(gpu, nodes=nodes, gpus_per_node=per_node, precision=precision)


def cpu_cluster(path: Path) -> Cluster:
    """A nominal CPU box for the CPU configs (the real one is probed at setup): enough memory, so only the
    structural checks can rule a layout out."""
    trainer = parsed_config(path)["trainer"]
    return Cluster(nodes=trainer["num_nodes"], gpus_per_node=trainer["devices"], memory_bytes=8 * GIB,
                   peak_flops=50e9, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, efficiency=1.0,
                   overlap_communication=False)


@functools.cache
def planned(path: Path) -> tuple[Training, list[Estimate], Estimate]:
    """The cluster config's training, the plan of its cluster, and its layout's estimate."""
    run = training(path, named_cluster(path))
    own = estimate(run.model, run.cluster, run.layout, run.global_batch, run.precision)
    return run, search.plan(run.model, run.cluster, run.global_batch, run.precision), own


def differences_from_file(file_value: Any, parsed_value: Any, where: str) -> list[str]:
    """Where the parsed config differs from a value the file sets: mappings key by key and lists item by item, since
    the parsed config adds the defaults the file leaves out (a callback's other ``init_args``)."""
    if isinstance(file_value, dict) and isinstance(parsed_value, dict):
        return [difference for key, value in file_value.items()
                for difference in differences_from_file(value, parsed_value.get(key, "<missing>"),
                                                        f"{where}.{key}")]
    if isinstance(file_value, list) and isinstance(parsed_value, list) and len(file_value) == len(parsed_value):
        return [difference for index, (value, parsed) in enumerate(zip(file_value, parsed_value))
                for difference in differences_from_file(value, parsed, f"{where}[{index}]")]
    return [] if file_value == parsed_value else [f"{where}: file {file_value!r}, parsed {parsed_value!r}"]


# ---------------------------------------------------------------------------------------------------- tests
def test_the_config_folder_holds_the_cluster_configs_and_the_recipes_cpu_defaults() -> None:
    assert len(cluster_configs()) >= 3, [path.name for path in CONFIGS]
    assert {pretrain_gpt.DEFAULT_CONFIG, finetune_hf.DEFAULT_CONFIG} <= set(cpu_configs())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_config_names_its_recipe_and_is_a_cpu_config_or_names_its_cluster(path: Path) -> None:
    header = read_header(path)
    trainer = parsed_config(path)["trainer"]
    if not header.names_a_cluster:
        assert trainer["accelerator"] == "cpu", (
            f"{path.name} runs on {trainer['accelerator']!r} but names no cluster: add the '# cluster:', '# plan:'"
            " and '# predicted:' lines (see this test's docstring), or make it a CPU config")
        return
    cluster = named_cluster(path)
    assert trainer["accelerator"] == "gpu"
    assert (trainer["num_nodes"], trainer["devices"]) == (cluster.nodes, cluster.gpus_per_node)
    missing = [key for key in ("model", "plan", "predicted") if getattr(header, key) is None]
    assert not missing, f"{path.name} names a cluster but lacks the header lines {missing}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_config_parses_through_its_recipe_with_every_value_it_sets(path: Path) -> None:
    written = yaml.safe_load(path.read_text())
    assert not differences_from_file(written, parsed_config(path), path.name)


@pytest.mark.parametrize("path", cluster_configs(), ids=lambda path: path.name)
def test_plan_command_describes_the_configs_model_cluster_batch_and_precision(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``# plan:`` command run in-process, its planning replaced by a recorder: the model, cluster, global
    batch and precision the command hands the planner are the config's."""
    command = read_header(path).plan
    assert command[0] == "lightning-hybrid" and command[1] == "plan", f"{path.name}: {command}"
    asked: list[tuple[ModelShape, Cluster, int, str]] = []
    monkeypatch.setattr(search, "plan", lambda *arguments, **options: asked.append(arguments) or [])
    lightning_hybrid_main(command[1:] + ["--json"])
    capsys.readouterr()
    run = training(path, named_cluster(path))
    assert asked == [(run.model, run.cluster, run.global_batch, run.precision)]


@pytest.mark.parametrize("path", cluster_configs(), ids=lambda path: path.name)
def test_configs_model_has_the_parameter_count_its_header_names(path: Path) -> None:
    name, count = re.fullmatch(r"(.+), ([\d,]+) parameters", read_header(path).model).groups()
    model = model_shape(path)
    assert model.total_parameters == number(count)
    assert name in PUBLISHED_PARAMETERS, f"{path.name}: no published parameter count of {name!r} to compare with"
    published, tolerance = PUBLISHED_PARAMETERS[name]
    assert model.total_parameters == pytest.approx(published, rel=tolerance, abs=0)


@pytest.mark.parametrize("path", cluster_configs(), ids=lambda path: path.name)
def test_configs_layout_fits_and_is_the_fastest_with_headroom(path: Path) -> None:
    arguments = strategy_arguments(path)
    unmodelled = {name: arguments[name] for name in UNMODELLED_DEFAULTS}
    assert unmodelled == UNMODELLED_DEFAULTS, "the cost model does not predict these"
    assert arguments["activation_checkpointing"] in (None, "every", "selective")  # the modes the planner prices
    assert arguments["pp"] == 1 or (arguments["pp_schedule"] in PLANNED_SCHEDULES
                                    and parsed_config(path)["trainer"]["accumulate_grad_batches"] == 1)
    run, ranked, own = planned(path)
    assert own.feasible, own.reasons
    roomy = [e for e in ranked if e.feasible and e.memory.total <= (1 - HEADROOM) * run.cluster.usable_memory]
    assert roomy, f"no layout of {path.name}'s cluster leaves {HEADROOM:.0%} of the usable memory free"
    assert own.layout == roomy[0].layout or own.time.step == roomy[0].time.step, (
        f"{path.name}: {own.layout} ({own.tokens_per_second:,.0f} tokens/s); the fastest with headroom is now"
        f" {roomy[0].layout} ({roomy[0].tokens_per_second:,.0f} tokens/s)")


@pytest.mark.parametrize("path", cluster_configs(), ids=lambda path: path.name)
def test_predicted_figures_in_the_header_agree_with_the_planner(path: Path) -> None:
    run, ranked, own = planned(path)
    feasible = [e for e in ranked if e.feasible]
    assert own.layout in [e.layout for e in feasible], own.reasons
    rank = next(index for index, e in enumerate(feasible, 1) if e.layout == own.layout)
    now = (f"{own.layout}, #{rank} of {len(feasible)} feasible layouts: {own.memory.total / GIB:.2f} GiB per GPU"
           f" ({run.cluster.usable_memory / GIB:.1f} usable), {own.tokens_per_second:,.0f} tokens/s,"
           f" MFU {own.mfu:.1%}")
    stated = read_header(path).predicted
    hint = f"{path.name}'s header says\n# predicted: {stated.text}\nthe planner now gives\n# predicted: {now}"
    assert (stated.layout, stated.rank, stated.feasible) == (str(own.layout), rank, len(feasible)), hint
    assert stated.usable_gib == pytest.approx(run.cluster.usable_memory / GIB, abs=0.05), hint
    assert stated.memory_gib == pytest.approx(own.memory.total / GIB, rel=TOLERANCE), hint
    assert stated.tokens_per_second == pytest.approx(own.tokens_per_second, rel=TOLERANCE), hint
    assert stated.mfu == pytest.approx(own.mfu, rel=TOLERANCE), hint


@pytest.mark.parametrize("path", cpu_configs(), ids=lambda path: path.name)
def test_cpu_configs_layout_passes_the_planners_structural_checks(path: Path) -> None:
    run = training(path, cpu_cluster(path))
    result = estimate(run.model, run.cluster, run.layout, run.global_batch, run.precision)
    assert result.memory.total < run.cluster.usable_memory
    assert set(result.reasons) <= set(KNOWN_PLANNER_LIMITATIONS), result.reasons

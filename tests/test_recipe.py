"""The main recipe runs with the strategy on CPU and writes TensorBoard logs that hold the training loss, the
strategy monitor's figures and the pipeline timeline; its console shows the whole model's summary, one current loss
and tokens/s over the logging window in the progress bar, and no warnings. Both recipes are LightningCLI programs:
their configuration round-trips through ``--print_config``, and command-line options reach ``HybridStrategy`` and
the links fill the derived values (checked without training). The main recipe's log, served by the real TensorBoard
server, shows the run's layout, tensor-parallel plan and stage split as text, the planner's ``plan/...`` figures next
to the measured ones, the timeline image, and a profiler window's trace beside it."""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.recompute import CheckpointPlan
from recipes import finetune_hf, pretrain_gpt
from recipes.gpt import GPT, GPTConfig
from tests.tensorboard_http import TensorBoardServer

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Console lines that are not the recipe's own: Python warnings (``file.py:123: ...``), C++ log lines of torch,
#: kineto or gloo (``USDT:2026-12-02 ...``, ``[W1202 04:25:01 ...``).
NOISE = re.compile(r"\.py:\d+: |^[A-Z]+:\d{4}-\d\d-\d\d |^\[[WEI]\d{4} |Warning")
#: Parameters of the recipe's GPT that tp=2 shards (half on each rank; the fused q|k|v bias like its weight, as
#: the recipe has no data-parallel sharding); the others are whole on every rank: the norms, the position embedding
#: and the row-parallel layers' biases.
TP_SHARDED = ("c_attn.weight", "c_attn.bias", "attn.c_proj.weight", "c_fc.weight", "c_fc.bias", "mlp.c_proj.weight",
              "wte.weight", "lm_head.weight")


@pytest.mark.slow
def test_recipe_defaults_train_tp_x_pp_and_log_to_tensorboard(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    drawn = tmp_path / "drawn.json"  # what the progress bar drew after each batch (tests/observe/drawn_bar.py)
    command = [sys.executable, "recipes/pretrain_gpt.py", "--trainer.max_steps", "20",
               "--trainer.logger.save_dir", str(tmp_path), "--trainer.strategy.monitor.timeline_every_n_steps", "10",
               "--trainer.strategy.monitor.peak_flops", "1e11", "--trainer.strategy.monitor.profile_steps", "3",
               "--trainer.callbacks+=tests.observe.drawn_bar.RecordingRichProgressBar",
               f"--trainer.callbacks.path={drawn}"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert "tensor-parallel plan (tp=2)" in output
    assert "pipeline 1f1b over 2 stages, blocks per stage [2, 2], 2 microbatches" in output
    assert "tokens/s:" in done.stdout and "train_loss:" in done.stdout  # Lightning's progress bar
    assert "=== pretrain_gpt summary ===" in done.stdout and "steps: 20" in done.stdout
    assert f"started fresh (no checkpoint in {tmp_path / 'checkpoints'})" in done.stdout
    assert_whole_model_summary(output)
    lines = [line for line in re.split(r"[\r\n]", output) if line.strip()]
    assert [line for line in lines if NOISE.search(line)] == []

    events = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {tmp_path}"
    assert (events[0].parent / "config.yaml").is_file()  # LightningCLI saves the run's configuration with its logs
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"images": 0})
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 2  # logged every 10 of 20 steps
    assert losses[-1] < losses[0] - 0.3  # the tiny GPT learns the generated grammar quickly
    for tag in ("throughput/tokens_per_sec", "flops/mfu", "memory/peak_gib_max", "pipeline/bubble",
                "pipeline/bubble_theory", "comm/share_of_step", "grad_norm"):
        assert len(accumulator.Scalars(tag)) == 2, tag
    mfu = accumulator.Scalars("flops/mfu")[-1].value
    tflops = accumulator.Scalars("flops/tflops_per_sec_per_device")[-1].value
    assert mfu == pytest.approx(tflops * 1e12 / 1e11)
    # After the third step (warm-up over), then every 10.
    assert [image.step for image in accumulator.Images("pipeline/timeline")] == [3, 10, 20]
    assert_one_current_loss_and_windowed_tokens_per_second(json.loads(drawn.read_text()), accumulator)
    assert_tensorboard_explains_the_run(tmp_path, events[0].parent, output)


def stage_rows() -> list[str]:
    """The stage split as the ``run/stages`` table renders: stage, blocks, parameters, held per rank."""
    plain = GPT(GPTConfig(vocab_size=64))
    first = ("wte.", "wpe.", "blocks.0.", "blocks.1.")
    rows = []
    for stage, blocks in ((0, "0–1"), (1, "2–3")):
        named = {n: p for n, p in plain.named_parameters() if n.startswith(first) == (stage == 0)}
        held = sum(p.numel() // (2 if n.endswith(TP_SHARDED) else 1) for n, p in named.items())
        rows.append(f"{stage} {blocks} {sum(p.numel() for p in named.values()):,} {held:,}")
    return rows


def assert_tensorboard_explains_the_run(log_dir: Path, run_dir: Path, output: str) -> None:
    """The real TensorBoard server over the recipe's log folder, read through its HTTP API (what its page shows):
    the layout, tp plan and stage split texts, the planner's predicted figures next to the measured ones (finite),
    the timeline image; and the profiler window's trace of every rank beside the run, valid Chrome-trace JSON."""
    run = run_dir.relative_to(log_dir).as_posix()
    wanted = {"plan/memory_gib", "plan/tokens_per_sec", "plan/step_time_sec", "memory/peak_gib_max",
              "throughput/tokens_per_sec", "throughput/step_time_sec"}
    with TensorBoardServer(log_dir) as board:
        board.wait_for(lambda b: wanted <= set(b.get("/data/plugin/scalars/tags").get(run, {})))
        assert {f"{tag}/text_summary" for tag in ("run/layout", "run/tp_plan", "run/stages", "plan/prediction")} <= set(
            board.get("/data/plugin/text/tags")[run])
        assert "pipeline/timeline" in board.get("/data/plugin/images/tags")[run]
        layout = board.text(run, "run/layout")
        for setting in ("world_size 4", "dp 1", "dp_replicate 1", "tp 2", "pp 2", "zero 2", "schedule 1f1b",
                        "microbatches 2", "virtual_stages 1", "activation_checkpointing none", "precision 32-true"):
            assert f" {setting} " in f" {layout} ", (setting, layout)
        printed = ast.literal_eval(re.search(r"tensor-parallel plan \(tp=2\): (\{.*\})", output).group(1))
        tp_plan = board.text(run, "run/tp_plan")
        assert len(printed) >= 4 and all(f"{name} {style}" in tp_plan for name, style in printed.items()), tp_plan
        stages = board.text(run, "run/stages")
        assert "HybridStrategy: 817,920 parameters in 2 pipeline stages, each on 2 ranks (tp 2 × dp 1):" in stages
        assert all(row in stages for row in stage_rows()), stages
        assert "dp1 tp2 pp2" in board.text(run, "plan/prediction")
        figures = {tag: board.scalars(run, tag)[-1][1] for tag in sorted(wanted)}
    print("predicted vs measured:", json.dumps(figures))
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures
    traces = sorted((run_dir / "profiler").glob("*.pt.trace.json"))
    assert [trace.name.split(".")[0] for trace in traces] == ["rank0", "rank1", "rank2", "rank3"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert sum(event.get("ph") == "X" for event in events) > 100  # complete events: operators, collectives


def assert_whole_model_summary(output: str) -> None:
    """The summary counts the whole model, not rank 0's stage, as the plain model counts it, and shows each stage:
    blocks 0-1 and the embeddings, blocks 2-3 with the final norm and the head; each rank holds its tp half."""
    plain = GPT(GPTConfig(vocab_size=64))  # the recipe's defaults (the corpus's vocabulary padded to 64)
    total = sum(p.numel() for p in plain.parameters())
    assert total == 817_920
    first = ("wte.", "wpe.", "blocks.0.", "blocks.1.")
    stages = [{n: p for n, p in plain.named_parameters() if n.startswith(first) == (stage == 0)} for stage in (0, 1)]
    assert "Total params: 817 K" in output and "│ 0 │ model │ GPT  │  817 K │" in output  # Lightning's table
    assert f"HybridStrategy: {total:,} parameters in 2 pipeline stages, each on 2 ranks (tp 2 × dp 1):" in output
    for index, stage in enumerate(stages):
        counted = sum(p.numel() for p in stage.values())
        held = sum(p.numel() // (2 if name.endswith(TP_SHARDED) else 1) for name, p in stage.items())
        assert f"  stage {index}: {counted:,} parameters, held per rank: {held:,}" in output
    assert [sum(p.numel() for p in stage.values()) for stage in stages] == [412_928, 404_992]


def assert_one_current_loss_and_windowed_tokens_per_second(records: list[dict], accumulator: EventAccumulator) -> None:
    """Every batch the bar showed one loss, the module's train_loss, equal to the loss that batch's step returned
    (the pipeline's last stage's); its tokens/s at each logging step is the window's figure logged to TensorBoard."""
    assert [record["batch"] for record in records] == list(range(20))
    for record in records:
        assert [key for key in record["drawn"] if "loss" in key] == ["train_loss"]
        assert record["drawn"]["train_loss"] == pytest.approx(record["step_loss"], rel=1e-6)
    assert all("tokens/s" not in record["drawn"] for record in records[:2])  # warm-up and profiled batches
    logged = {event.step: event.value for event in accumulator.Scalars("throughput/tokens_per_sec")}
    assert logged.keys() == {10, 20}
    for step, value in logged.items():
        assert records[step - 1]["drawn"]["tokens/s"] == pytest.approx(value, rel=1e-6)  # TensorBoard keeps float32


@pytest.mark.slow
def test_fine_tuning_recipe_loads_trains_exports_and_reloads_with_from_pretrained(tmp_path: Path) -> None:
    """recipes/finetune_hf.py with its defaults (tp=2 x pp=2 on 4 CPU processes): a saved Hugging Face checkpoint
    read into the shards, fine-tuned, exported, and reloaded by transformers, better than before."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "recipes/finetune_hf.py", "--trainer.max_steps", "20", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if ": " in line and "val loss" in line}
    before, after = (float(lines[key].split("val loss ")[1].split(",")[0]) for key in ("pretrained", "fine-tuned"))
    assert after < before - 1.0  # 20 steps learn much of the reversal task
    assert (tmp_path / "hf" / "config.json").is_file() and any((tmp_path / "hf").glob("*.safetensors"))
    events = sorted((tmp_path / "logs").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    assert len(accumulator.Scalars("train_loss")) == 2  # logged every 10 of 20 steps


def printed_config(recipe: Callable[[list[str]], Any], args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``recipe`` prints for ``args + ["--print_config"]`` (it exits after printing)."""
    with pytest.raises(SystemExit) as exited:
        recipe([*args, "--print_config"])
    assert exited.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("recipe", [pretrain_gpt.main, finetune_hf.main], ids=["pretrain_gpt", "finetune_hf"])
def test_print_config_round_trips_and_shows_the_strategy_options(
    recipe: Callable[[list[str]], Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    printed = printed_config(recipe, ["--trainer.strategy.tp", "4", "--trainer.strategy.pp", "1"], capsys)
    saved = tmp_path / "config.yaml"
    saved.write_text(printed)
    assert printed_config(recipe, ["--config", str(saved)], capsys) == printed
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hybrid.HybridStrategy"
    assert (strategy["init_args"]["tp"], strategy["init_args"]["pp"]) == (4, 1)


def test_command_line_reaches_the_strategy_and_links_fill_derived_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default subcommand is fit; Trainer.fit is replaced (keeping its signature, from which LightningCLI takes
    fit's options) so that the recipe builds everything and trains nothing."""
    fits: list[dict[str, Any]] = []

    @functools.wraps(Trainer.fit)
    def record_fit(trainer: Trainer, **kwargs: Any) -> None:
        fits.append(kwargs)

    monkeypatch.setattr(Trainer, "fit", record_fit)
    cli = pretrain_gpt.main([
        "--trainer.strategy.tp", "4", "--trainer.strategy.pp", "1", "--trainer.strategy.activation_checkpointing", "2",
        "--trainer.strategy.monitor.peak_flops", "1e11", "--trainer.logger.save_dir", str(tmp_path),
        "--trainer.max_steps", "30", "--data.num_chars", "20000",
    ])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HybridStrategy)
    assert (strategy.options.dp, strategy.options.tp, strategy.options.pp) == ("auto", 4, 1)
    assert strategy.options.checkpointing == CheckpointPlan(every=2)  # "2" read as every 2nd block, not a name
    assert cli.config.fit.trainer.strategy.init_args.monitor.init_args.peak_flops == 1e11
    assert [fit["ckpt_path"] for fit in fits] == ["last"]
    # The links: the data's padded vocabulary, the model's block size, the schedule's length, the checkpoint folder.
    assert cli.model.config.vocab_size == 64 > cli.datamodule.tokenizer.vocab_size
    assert cli.datamodule.block_size == cli.model.config.block_size == 64
    assert cli.model.max_steps == cli.trainer.max_steps == 30
    (checkpoint,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, ModelCheckpoint)]
    assert Path(checkpoint.dirpath) == tmp_path / "checkpoints" and checkpoint.save_top_k == 2


def test_the_gpt_built_on_the_meta_device_gets_gpt2s_initialization() -> None:
    """``GPTLightning(meta_init=True)``: no tensor before ``configure_model``, meta tensors after it, and the
    strategy's per-module initialization through ``init_module_weights`` gives GPT-2's scheme: normal(0, 0.02)
    matrices and embeddings, the residual projections scaled by 1/sqrt(2 · layers), zero biases, unit norms."""
    import torch

    from lightning_hybrid.parallel.initialization import init_weights
    from recipes.gpt import GPTConfig, GPTLightning

    config = GPTConfig(vocab_size=96, block_size=64, n_layer=8, n_head=4, n_embd=128)
    module = GPTLightning(config, meta_init=True)
    assert module.model is None
    module.configure_model()
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    init_weights(module, seed=3)
    eager = dict(GPTLightning(config).named_parameters())
    for name, param in module.named_parameters():
        assert param.shape == eager[name].shape, name
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name
        elif param.ndim == 1:
            assert torch.equal(param, torch.ones_like(param)), name  # LayerNorm weights
        else:
            std = 0.02 / 4.0 if name.endswith("c_proj.weight") else 0.02  # 1/sqrt(2 * 8 layers)
            assert abs(param.std().item() - std) < 0.05 * std, (name, param.std().item())
            assert not torch.equal(param, eager[name])  # its own draws, not the eager build's

"""``HybridStrategy``'s options are declared once, as the fields of ``HybridOptions``: the strategy's signature, its
docstring and the recipes' ``--help`` are generated from them (:mod:`lightning_hybrid.options.keywords`), keyword
arguments work as before, a wrong name fails naming it and the valid ones, and a new field reaches all of them."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

import docstring_parser
import pytest
from jsonargparse import ArgumentParser

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.keywords import keyword_options, options_from
from lightning_hybrid.options.hybrid_options import HybridOptions
from recipes import finetune_hf, pretrain_gpt

#: The strategy's arguments that are not options (they configure Lightning's process group and the monitor).
EXPLICIT = ["process_group_backend", "timeout", "monitor"]


def init_fields(options_class: type) -> list[dataclasses.Field]:
    return [field for field in dataclasses.fields(options_class) if field.init]


def documented(cls: type) -> dict[str, str]:
    """``{parameter: description}`` of ``cls``'s docstring, parsed as jsonargparse parses it."""
    return {param.arg_name: param.description for param in docstring_parser.parse(cls.__doc__).params}


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)  # argparse wraps help text anywhere, even inside a long word


def test_the_signature_is_the_options_fields_then_the_explicit_arguments() -> None:
    parameters = inspect.signature(HybridStrategy).parameters
    assert list(parameters) == [field.name for field in init_fields(HybridOptions)] + EXPLICIT
    hints = typing.get_type_hints(HybridOptions)
    for field in init_fields(HybridOptions):
        parameter = parameters[field.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert (parameter.default, parameter.annotation) == (field.default, hints[field.name]), field.name


def test_every_argument_is_documented_and_the_options_as_the_dataclass_documents_them() -> None:
    strategy_docs, option_docs = documented(HybridStrategy), documented(HybridOptions)
    assert set(option_docs) == {field.name for field in init_fields(HybridOptions)}  # a new field needs its entry
    assert list(strategy_docs) == list(inspect.signature(HybridStrategy).parameters)
    assert {name: strategy_docs[name] for name in option_docs} == option_docs
    assert all(strategy_docs[name].strip() for name in EXPLICIT)


def test_keyword_arguments_build_the_options_as_before() -> None:
    strategy = HybridStrategy(tp=2, pp=2, pp_schedule="gpipe", monitor=False)
    assert strategy.options == HybridOptions(tp=2, pp=2, pp_schedule="gpipe")
    assert strategy.options.pipeline_schedule.name == "gpipe" and strategy._monitor is False
    assert HybridStrategy(save_distributed_checkpoint=False)._save_distributed_checkpoint is False  # Lightning's too


def test_from_options_takes_a_built_hybrid_options() -> None:
    options = HybridOptions(tp=2, pp=2, activation_checkpointing="every", microbatches=4)
    assert HybridOptions(**options.arguments()) == options
    strategy = HybridStrategy.from_options(options, monitor=False)
    assert strategy.options == options and strategy._monitor is False
    with pytest.raises(TypeError, match="multiple values for keyword argument 'tp'"):
        HybridStrategy.from_options(options, tp=4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(tpp=2), r"HybridStrategy\(\) got unexpected keyword argument\(s\) 'tpp' \('tpp': did you mean 'tp'\?\)"),
        (dict(pipeline_schedule="gpipe"), r"'pipeline_schedule'"),  # a derived field is no argument
        (dict(devices=2), r"'devices'\. Its arguments: dp, tp, pp, .*, process_group_backend, timeout, monitor\.$"),
    ],
)
def test_a_wrong_name_is_refused_naming_it_and_the_valid_ones(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        HybridStrategy(**arguments)


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="positional argument"):
        HybridStrategy(2)  # type: ignore[misc]


def strategy_help(recipe: Callable[[list[str]], Any]) -> str:
    """What ``recipe --trainer.strategy.help lightning_hybrid.HybridStrategy`` prints (LightningCLI's help of the
    strategy's arguments; it exits after printing)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exited:
        recipe(["fit", "--trainer.strategy.help", "lightning_hybrid.HybridStrategy"])
    assert exited.value.code in (0, None)
    return printed.getvalue()


def help_entries(text: str, prefix: str) -> dict[str, str]:
    """``{argument: its help entry}`` of argparse's help ``text`` for the arguments ``--<prefix>.<name>`` (not their
    ``--<prefix>.<name>.help`` entries)."""
    entries: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        start = re.match(rf"  --{re.escape(prefix)}\.(\w+)(?:[ ,]|$)", line)
        if start or line.startswith("  -"):
            name = start and start.group(1)
        if name:
            entries[name] = entries.get(name, "") + line + "\n"
    return entries


@pytest.mark.parametrize("recipe", [pretrain_gpt.main, finetune_hf.main], ids=["pretrain_gpt", "finetune_hf"])
def test_recipe_help_describes_every_strategy_argument(recipe: Callable[[list[str]], Any]) -> None:
    entries, docs = help_entries(strategy_help(recipe), "trainer.strategy"), documented(HybridStrategy)
    assert list(entries) == list(docs) == list(inspect.signature(HybridStrategy).parameters)
    for name, description in docs.items():
        # The description comes before jsonargparse's "(type: ..., default: ...)".
        text = squeezed(entries[name].split("(type:")[0])
        assert squeezed(description)[:60] in text, f"--trainer.strategy.{name}: {entries[name]}"


# ----------------------------------------------------------------------- a new option is one field (and its entry)
@dataclass(frozen=True)
class Options:
    """Options.

    Arguments:
        width: How wide.
    """

    width: int = 1


@dataclass(frozen=True)
class MoreOptions(Options):
    """Options with one more field: the only edit.

    Arguments:
        width: How wide.
        depth: How deep, or ``None``.
    """

    depth: Optional[int] = None


def strategy_class(options_class: type) -> type:
    """A strategy written as ``HybridStrategy`` is, for ``options_class``."""

    @keyword_options(options_class)
    class Strategy:
        """A strategy.

        Arguments:
            monitor: Whether to watch.
        """

        def __init__(self, *, monitor: bool = True, **option_values: Any) -> None:
            self.options = options_from(options_class, option_values, type(self))
            self.monitor = monitor

    return Strategy


def test_a_new_field_reaches_the_signature_the_docstring_the_cli_and_the_options() -> None:
    before, after = strategy_class(Options), strategy_class(MoreOptions)
    assert list(inspect.signature(before).parameters) == ["width", "monitor"]
    assert list(inspect.signature(after).parameters) == ["width", "depth", "monitor"]
    assert documented(after) == {"width": "How wide.", "depth": "How deep, or ``None``.", "monitor": "Whether to watch."}
    assert after(depth=3, monitor=False).options == MoreOptions(depth=3)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(after, "strategy")
    assert "How deep" in parser.format_help()
    parsed = parser.parse_args(["--strategy.depth", "3"]).strategy.as_dict()
    assert parsed == {"width": 1, "depth": 3, "monitor": True}
    assert after(**parsed).options == MoreOptions(depth=3)
    with pytest.raises(TypeError, match=r"'height'.*Its arguments: width, depth, monitor\."):
        after(height=2)


def test_the_decorator_refuses_a_class_without_its_own_init() -> None:
    base = strategy_class(Options)
    with pytest.raises(TypeError, match="needs Subclass to define its own __init__"):
        keyword_options(MoreOptions)(type("Subclass", (base,), {}))
    assert list(inspect.signature(base).parameters) == ["width", "monitor"]  # the base's signature left alone
